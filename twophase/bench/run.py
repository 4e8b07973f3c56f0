"""``twophase bench``: every backend (and the HF reference) through the same phase sweeps and
serving workload, in one process, rounds interleaved across them so drift hits all alike; each
figure also shown against the calibrated roofline."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from twophase.bench import calibrate, serving, sweeps
from twophase.bench.roofline import CostModel
from twophase.config import Config, SchedulerConfig, SpeculativeConfig
from twophase.errors import ConfigError

log = logging.getLogger(__name__)


def _bench_llm(cfg: Config, backend: str):
    """An LLM for ``backend`` whose scheduler suits the sweeps (one prompt = one step) and whose
    pool fits the sweeps and the serving workload alike."""
    from twophase.llm import LLM

    b, sc, cc = cfg.bench, cfg.scheduler, cfg.cache
    bs = cc.block_size
    blocks = lambda tokens: -(-tokens // bs)  # noqa: E731
    s = b.serving
    # room for every decode sweep's contexts at once, so later rounds find them in the prefix cache
    longest_request = blocks(s.input_len[1] + s.output_len[1])
    need = max(sum(b.batch_sizes) * blocks(b.decode_context + b.decode_steps + 2),
               2 * blocks(b.cache_depth + max(b.prompt_lens) + 2),
               sc.max_num_seqs * longest_request,
               blocks(max(b.prompt_lens) + s.output_len[1]) + max(b.batch_sizes) * longest_request)
    num_blocks = cc.num_blocks if isinstance(cc.num_blocks, int) else need + 8
    sweep_sched = SchedulerConfig(policy="prefill-first",
                                  max_num_seqs=max(max(b.batch_sizes), sc.max_num_seqs),
                                  max_num_batched_tokens=max(max(b.prompt_lens), max(b.batch_sizes) + 1),
                                  chunked_prefill=True)
    device = cfg.phases()[0].device
    run_cfg = dataclasses.replace(
        cfg, backend=dataclasses.replace(cfg.backend, name=backend, device=device, prefill=None,
                                         decode=None,
                                         options=cfg.backend.options if backend == cfg.backend.name else {}),
        scheduler=sweep_sched, cache=dataclasses.replace(cc, num_blocks=num_blocks, prefix_caching=True),
        speculative=SpeculativeConfig())       # the sweeps measure plain steps; --speculative adds a line
    return LLM(run_cfg)


def _measured(seconds: list[float], tokens: int, cost, ceil) -> dict[str, float]:
    m = sweeps.spread(seconds)
    t = m["median"]
    return {"median_s": t, "min_s": m["min"], "max_s": m["max"], "rounds": m["rounds"],
            "tokens_per_s": tokens / t, "flops_per_s": cost.flops / t, "bytes_per_s": cost.bytes / t,
            "roofline_fraction": cost.bound_s(ceil.peak_flops, ceil.bandwidth) / t}


def _check_backends(names: list[str], device: str) -> None:
    from twophase.backends.registry import Registry

    reg = Registry()
    for name in names:
        reg.get(name, "bench.backends")                      # unknown names: a config error
        why = reg.availability(name, device)
        if why:
            raise ConfigError("bench.backends", f"{name} cannot run on {device} here: {why}")


def _round(line: str, eng: Any, phase: str, x: int, b: Any, k: int) -> float:
    """One timed round of ``phase`` at ``x`` (prompt length or batch size) on one line."""
    if line == "hf":
        return (eng.prefill_round(x, b.cache_depth, k) if phase == "prefill"
                else eng.decode_round(x, b.decode_context, b.decode_steps, k))
    return (sweeps.prefill_round(eng, x, b.cache_depth, k) if phase == "prefill"
            else sweeps.decode_round(eng, x, b.decode_context, b.decode_steps, k))


def run(cfg: Config, backends: list[str] | None = None, compare_chunked: bool = False,
        command: str | None = None, speculative: bool = False) -> dict[str, Any]:
    b = cfg.bench
    names = backends or b.backends
    device = cfg.phases()[0].device
    _check_backends(names, device)
    llms = {name: _bench_llm(cfg, name) for name in names}
    first = llms[names[0]]
    b, skipped = sweeps.servable(b, first.max_model_len)
    arch, dtype = first.model.arch, first.model.dtype
    kv_dtype = first.kv_cache.pool.dtype
    cost = CostModel(arch, dtype.itemsize, kv_dtype.itemsize)
    ceil = calibrate.ceilings(device, dtype)
    lines = dict(llms)
    if b.baseline == "hf":
        from twophase.bench.hf_baseline import HFBaseline

        lines["hf"] = HFBaseline(first)
    s = b.serving
    if s.jsonl:
        requests = serving.trace(cfg.resolve(s.jsonl), s.rate, s.output_len[1], s.seed)
    else:
        requests = serving.synthetic(s.num_requests, s.rate, s.input_len, s.output_len,
                                     arch.vocab_size, s.seed)
    cases = [("prefill", n) for n in b.prompt_lens] + [("decode", x) for x in b.batch_sizes]
    times: dict[str, dict[str, dict[int, list[float]]]] = {
        ph: {line: {} for line in lines} for ph in ("prefill", "decode")}
    total = (b.repeats * len(cases) * len(lines) + len(lines) + (2 if compare_chunked else 0)
             + (1 if speculative else 0))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=not sys.stderr.isatty()) as progress:
        task = progress.add_task("bench", total=total)
        for k in range(b.repeats):
            for phase, x in cases:
                for line, eng in lines.items():       # interleaved: each round visits every line
                    progress.update(task, description=f"round {k + 1}/{b.repeats}: {phase} {x} on {line}")
                    times[phase][line].setdefault(x, []).append(_round(line, eng, phase, x, b, k))
                    progress.advance(task)
        served = {}
        for line, eng in lines.items():
            progress.update(task, description=f"serving workload on {line}")
            if line == "hf":
                served[line] = eng.serve(requests, b.hf_batch_size)
            else:
                eng.reschedule(cfg.scheduler)
                served[line] = serving.run(eng.engine, requests)
            progress.advance(task)
        if speculative:
            progress.update(task, description=f"serving workload on {names[0]}, speculative")
            label, spec = _speculative_line(cfg, names[0])
            first.config = dataclasses.replace(first.config, speculative=spec)
            first.reschedule(cfg.scheduler)
            served[label] = serving.run(first.engine, requests)
            first.config = dataclasses.replace(first.config, speculative=SpeculativeConfig())
            progress.advance(task)
        chunked = {}
        if compare_chunked:
            long_n = max(b.prompt_lens)
            for mode in ("on", "off"):
                progress.update(task, description=f"chunked prefill {mode} on {names[0]}")
                budget = cfg.scheduler.max_num_batched_tokens if mode == "on" else long_n + s.output_len[1]
                first.reschedule(dataclasses.replace(cfg.scheduler, chunked_prefill=mode == "on",
                                                     max_num_batched_tokens=budget))
                chunked[mode] = _long_prompt_among_decodes(first.engine, requests, long_n,
                                                           s.output_len[1])
                progress.advance(task)

    res: dict[str, Any] = {
        "command": command or "twophase bench", "model": first.model.model_id, "device": device,
        "dtype": str(dtype).removeprefix("torch."), "lines": list(lines), "repeats": b.repeats,
        "decode_context": b.decode_context, "cache_depth": b.cache_depth,
        "ceilings": dataclasses.asdict(ceil),
        "shapes": {"prefill": b.prompt_lens, "decode": b.batch_sizes},
        "prefill": {line: {str(n): _measured(v, n, cost.prefill(n, b.cache_depth), ceil)
                           for n, v in times["prefill"][line].items()} for line in lines},
        "decode": {line: {str(x): _measured(v, x, cost.decode(x, b.decode_context), ceil)
                          for x, v in times["decode"][line].items()} for line in lines},
        "serving": served,
        "serving_workload": _describe_workload(s, len(requests)),
        "load_time_s": {name: llm.load_time_s for name, llm in llms.items()},
        "skipped": skipped,
    }
    res["roofline"] = _roofline(cost, b, ceil, served)
    if chunked:
        res["chunked"] = chunked
        res["chunked_long_prompt"] = max(b.prompt_lens)
    return res


def _roofline(cost, b, ceil, served: dict[str, Any]) -> dict[str, Any]:
    """Each phase's arithmetic intensity and bound, and what speculation did to decode's."""
    big = max(b.prompt_lens)
    out = {
        "prefill_intensity": cost.prefill(big, b.cache_depth).intensity, "prefill_intensity_at": big,
        "decode_intensity_b1": cost.decode(1, b.decode_context).intensity,
        "decode_intensity": {str(x): cost.decode(x, b.decode_context).intensity for x in b.batch_sizes},
        "decode_crossover_batch": cost.decode_crossover(b.decode_context, ceil.peak_flops, ceil.bandwidth),
        "prefill_bound_tokens_per_s": {str(n): n / cost.prefill(n, b.cache_depth).bound_s(
            ceil.peak_flops, ceil.bandwidth) for n in b.prompt_lens},
        "decode_bound_tokens_per_s": {str(x): x / cost.decode(x, b.decode_context).bound_s(
            ceil.peak_flops, ceil.bandwidth) for x in b.batch_sizes},
    }
    for line, s in served.items():
        if "speculative" in line and s.get("speculative"):
            out["speculative"] = {"line": line, **cost.speculative_intensity(b.decode_context, s["speculative"])}
    return out


def _speculative_line(cfg: Config, backend: str) -> tuple[str, SpeculativeConfig]:
    """The config's [speculative] section, else n-gram drafts with num_tokens = "auto"."""
    spec = cfg.speculative if cfg.speculative.method != "none" else \
        SpeculativeConfig(method="ngram", num_tokens="auto")
    return f"{backend}, speculative {spec.method} k={spec.num_tokens}", spec


def _long_prompt_among_decodes(engine, requests, n: int, max_tokens: int) -> dict[str, Any]:
    """Half the workload's requests start together; once each has two output tokens (all are
    decoding), an ``n``-token prompt arrives. Without chunked prefill its whole prefill lands in
    one step, and every running decode waits for it: the ITL spike this run shows."""
    from twophase.core.params import SamplingParams

    p = lambda m: SamplingParams(max_tokens=m, ignore_eos=True)  # noqa: E731
    start = engine.clock()
    shorts = [engine.add_request(r.prompt, p(max(r.max_tokens, 8)))
              for r in requests[: max(2, len(requests) // 2)]]
    while any(len(r.times.token_times) < 2 for r in shorts if not r.finished):
        engine.step()
    long = engine.add_request(sweeps.tokens(n, 99991, engine.vocab_size), p(max_tokens))
    while engine.has_unfinished():
        engine.step()
    out = serving.summary(shorts + [long], engine.clock() - start)
    gaps = sorted((b, b - a) for r in shorts for a, b in zip(r.times.token_times, r.times.token_times[1:]))
    out["itl_timeline"] = [g for _, g in gaps]
    return out


def _describe_workload(s, n: int) -> str:
    if s.jsonl:
        src = f"trace {s.jsonl}"
    else:
        src = f"prompts {s.input_len[0]}–{s.input_len[1]} tokens, outputs {s.output_len[0]}–{s.output_len[1]}"
    arrivals = f"Poisson arrivals at {s.rate:g} req/s" if s.rate else "all at once"
    return f"{n} requests, {src}, {arrivals}"


def command_line(argv: list[str]) -> str:
    return "twophase " + " ".join(shlex.quote(a) for a in argv)


def write(res: dict[str, Any], out: Path) -> list[Path]:
    from twophase.bench.report import write_all

    return write_all(res, Path(out))
