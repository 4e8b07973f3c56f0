"""``twophase bench``: every backend (and the HF reference) through the same phase sweeps and
serving workload, in one process, rounds interleaved across them so drift hits all alike (after
one untimed warm-up round of each); each figure also shown against the calibrated roofline, and
the machine's load recorded beside them."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from twophase.bench import calibrate, serving, sweeps
from twophase.bench.isolated import ISOLATED, IsolatedLine
from twophase.bench.lines import bench_llm as _bench_llm  # the name run has always called it by
from twophase.bench.roofline import CostModel
from twophase.config import Config, SpeculativeConfig
from twophase.errors import ConfigError
from twophase.measure import machine

log = logging.getLogger(__name__)


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
    """One round of ``phase`` at ``x`` (prompt length or batch size) on one line."""
    if line == "hf" or isinstance(eng, IsolatedLine):
        return (eng.prefill_round(x, b.cache_depth, k) if phase == "prefill"
                else eng.decode_round(x, b.decode_context, b.decode_steps, k))
    return (sweeps.prefill_round(eng, x, b.cache_depth, k) if phase == "prefill"
            else sweeps.decode_round(eng, x, b.decode_context, b.decode_steps, k))


MIN_REPEATS = 3                # a median and a spread need three rounds at least


def _enough_rounds(b):
    """``b`` with at least ``MIN_REPEATS`` rounds (fewer gives a median of two, or of one)."""
    if b.repeats >= MIN_REPEATS:
        return b
    log.warning("bench.repeats = %d raised to %d: a median and its spread need %d rounds at least",
                b.repeats, MIN_REPEATS, MIN_REPEATS)
    return dataclasses.replace(b, repeats=MIN_REPEATS)


class Phases:
    """Progress: a rich bar on a terminal; elsewhere (a log file, CI) one log line a phase, since
    a bar redrawn in place leaves nothing readable there."""

    def __init__(self, total: int, name: str = "bench"):
        self.start, self.name = time.perf_counter(), name
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn()) if sys.stderr.isatty() else None
        self.total = total

    def __enter__(self) -> Phases:
        if self.bar:
            self.bar.__enter__()
            self.task = self.bar.add_task(self.name, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.__exit__(*exc)

    def phase(self, text: str) -> None:
        """A new phase: logged where there is no bar."""
        if self.bar:
            self.bar.update(self.task, description=text)
        else:
            log.info("%s [%.1f s]: %s", self.name, time.perf_counter() - self.start, text)

    def item(self, text: str) -> None:
        """A step within a phase: shown on the bar only."""
        if self.bar:
            self.bar.update(self.task, description=text)

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)


def _sweeps(lines: dict[str, Any], cases: list[tuple[str, int]], b: Any,
            progress: Phases) -> dict[str, dict[str, dict[int, list[float]]]]:
    """One untimed warm-up round of every case on every line (first calls compile, allocate and
    fill the prefix cache), then ``b.repeats`` timed rounds, interleaved across lines."""
    times: dict[str, dict[str, dict[int, list[float]]]] = {
        ph: {line: {} for line in lines} for ph in ("prefill", "decode")}
    progress.phase(f"warm-up: one untimed round of {len(cases)} cases on {', '.join(lines)}")
    for phase, x in cases:
        for line, eng in lines.items():
            progress.item(f"warm-up: {phase} {x} on {line}")
            _round(line, eng, phase, x, b, -1)
            progress.advance()
    for k in range(b.repeats):
        progress.phase(f"round {k + 1}/{b.repeats}: {len(cases)} cases on {', '.join(lines)}")
        for phase, x in cases:
            for line, eng in lines.items():       # interleaved: each round visits every line
                progress.item(f"round {k + 1}/{b.repeats}: {phase} {x} on {line}")
                times[phase][line].setdefault(x, []).append(_round(line, eng, phase, x, b, k))
                progress.advance()
    return times


def _serve(cfg: Config, lines: dict[str, Any], requests, progress: Phases) -> dict[str, Any]:
    served = {}
    for line, eng in lines.items():
        progress.phase(f"serving workload on {line}")
        if line == "hf":
            served[line] = eng.serve(requests, cfg.bench.hf_batch_size)
        elif isinstance(eng, IsolatedLine):
            served[line] = eng.serve(cfg.scheduler, requests)
        else:
            eng.reschedule(cfg.scheduler)
            served[line] = serving.run(eng.engine, requests)
        progress.advance()
    return served


def _serve_speculative(cfg: Config, name: str, first, requests, progress: Phases) -> tuple[str, dict]:
    progress.phase(f"serving workload on {name}, speculative")
    label, spec = _speculative_line(cfg, name)
    first.reschedule(cfg.scheduler, spec)
    out = serving.run(first.engine, requests)
    first.reschedule(cfg.scheduler, SpeculativeConfig())
    progress.advance()
    return label, out


def _compare_chunked(cfg: Config, b, name: str, first, requests, progress: Phases) -> dict[str, Any]:
    long_n, s = max(b.prompt_lens), b.serving
    chunked = {}
    for mode in ("on", "off"):
        progress.phase(f"a long prompt among decodes on {name}, chunked prefill {mode}")
        budget = cfg.scheduler.max_num_batched_tokens if mode == "on" else long_n + s.output_len[1]
        first.reschedule(dataclasses.replace(cfg.scheduler, chunked_prefill=mode == "on",
                                             max_num_batched_tokens=budget))
        chunked[mode] = _long_prompt_among_decodes(first.engine, requests, long_n, s.output_len[1])
        progress.advance()
    return chunked


def _requests(cfg: Config, s, vocab: int):
    if s.jsonl:
        return serving.trace(cfg.resolve(s.jsonl), s.rate, s.output_len[1], s.seed)
    return serving.synthetic(s.num_requests, s.rate, s.input_len, s.output_len, vocab, s.seed)


def _outliers(times: dict[str, dict[str, dict[int, list[float]]]]) -> list[dict[str, Any]]:
    """Every round more than ``sweeps.OUTLIER`` times off the median of its case's rounds."""
    return [{"phase": phase, "shape": x, "line": line, "round": i + 1, "seconds": v, "median_s": m}
            for phase, by_line in times.items() for line, by_x in by_line.items()
            for x, values in by_x.items() for i, v, m in sweeps.outliers(values)]


def _baseline(b, first) -> tuple[Any, str | None]:
    """The HF reference line, or None and why there is none (the report says it)."""
    if b.baseline != "hf":
        return None, f'bench.baseline = "{b.baseline}"'
    from twophase.bench.hf_baseline import HFBaseline

    try:
        return HFBaseline(first), None
    except ImportError as exc:                       # transformers (or a part it needs) is absent
        log.warning("no HF baseline: %s", exc)
        return None, f"transformers cannot be imported ({exc})"


SMALL_MODEL_BYTES = 64 << 20      # weights a step reads, below which torch runs on one thread


def _threads_for_size(cfg: Config, device: str, cost: CostModel) -> None:
    """One torch thread for a small model on the CPU, unless ``backend.options.threads`` says
    otherwise: its ops last microseconds, so threads spend a step waiting for each other, the
    more so beside a busy process (docs/measurements.md). Set before calibrating, so the
    ceilings are those of the threads the bench uses."""
    if device != "cpu" or "threads" in cfg.backend.options or cost.weight_bytes_per_step >= SMALL_MODEL_BYTES:
        return
    if torch.get_num_threads() != 1:
        log.info("a %.1f MB model: torch on one thread (set backend.options.threads to choose)",
                 cost.weight_bytes_per_step / 1e6)
        torch.set_num_threads(1)


def _start_sample() -> machine.Sample:
    """The machine's state before anything loads, with a warning now if it is busy."""
    before = machine.sample()
    cores = before.cpus
    if before.load1 is not None and before.load1 > machine.QUIET_LOAD * cores:
        log.warning("the machine is busy (1-minute load %.2f on %d cores): figures will be slow and "
                    "noisy; results.json and the report record it", before.load1, cores)
    return before


def run(cfg: Config, backends: list[str] | None = None, compare_chunked: bool = False,
        command: str | None = None, speculative: bool = False) -> dict[str, Any]:
    b = _enough_rounds(cfg.bench)
    names = backends or b.backends
    device = cfg.phases()[0].device
    _check_backends(names, device)
    before = _start_sample()
    llms = _lines(cfg, names)
    try:
        return _run(cfg, b, names, llms, before, compare_chunked, command, speculative)
    finally:
        for llm in llms.values():
            if isinstance(llm, IsolatedLine):
                llm.close()


def _lines(cfg: Config, names: list[str]) -> dict[str, Any]:
    """Each backend's LLM; those in ``ISOLATED`` but the first in a process of their own (the
    first line also runs the speculative and chunked comparisons, here)."""
    llms: dict[str, Any] = {}
    for i, name in enumerate(names):
        if name in ISOLATED and i > 0:
            log.info("%s: benched in a process of its own (its runtime keeps what each new shape "
                     "allocated)", name)
            llms[name] = IsolatedLine(cfg, name)
        else:
            llms[name] = _bench_llm(cfg, name)
    return llms


def _run(cfg: Config, b, names: list[str], llms: dict[str, Any], before, compare_chunked: bool,
         command: str | None, speculative: bool) -> dict[str, Any]:
    device = cfg.phases()[0].device
    first = llms[names[0]]
    b, skipped = sweeps.servable(b, first.max_model_len)
    arch, dtype = first.model.arch, first.model.dtype
    cost = CostModel(arch, dtype.itemsize, first.kv_cache.pool.dtype.itemsize)
    _threads_for_size(cfg, device, cost)
    ceil = calibrate.engine_ceilings(device, first.decode_backend.compute_dtype("decode") or dtype, dtype)
    pceil = calibrate.engine_ceilings(device, first.prefill_backend.compute_dtype("prefill") or dtype, dtype)
    lines: dict[str, Any] = dict(llms)
    hf, no_baseline = _baseline(b, first)
    if hf is not None:
        lines["hf"] = hf
    requests = _requests(cfg, b.serving, arch.vocab_size)
    cases = [("prefill", n) for n in b.prompt_lens] + [("decode", x) for x in b.batch_sizes]
    total = ((b.repeats + 1) * len(cases) * len(lines) + len(lines) + (2 if compare_chunked else 0)
             + (1 if speculative else 0))
    with Phases(total) as progress:
        times = _sweeps(lines, cases, b, progress)
        served = _serve(cfg, lines, requests, progress)
        if speculative:
            label, served[label] = _serve_speculative(cfg, names[0], first, requests, progress)
        chunked = _compare_chunked(cfg, b, names[0], first, requests, progress) if compare_chunked else {}
    res: dict[str, Any] = {
        "command": command or "twophase bench", "model": first.model.model_id, "device": device,
        "dtype": str(dtype).removeprefix("torch."), "lines": list(lines), "repeats": b.repeats,
        "repeats_requested": cfg.bench.repeats, "warmup_rounds": 1, "torch_threads": torch.get_num_threads(),
        "decode_context": b.decode_context, "cache_depth": b.cache_depth,
        "ceilings": dataclasses.asdict(ceil),              # decode's engine
        "prefill_ceilings": dataclasses.asdict(pceil),     # prefill's, where its matmuls run otherwise
        "machine": machine.between(before, machine.sample()),
        "shapes": {"prefill": b.prompt_lens, "decode": b.batch_sizes},
        "prefill": {line: {str(n): _measured(v, n, cost.prefill(n, b.cache_depth), pceil)
                           for n, v in times["prefill"][line].items()} for line in lines},
        "decode": {line: {str(x): _measured(v, x, cost.decode(x, b.decode_context), ceil)
                          for x, v in times["decode"][line].items()} for line in lines},
        "outliers": _outliers(times),
        "serving": served,
        "serving_workload": _describe_workload(b.serving, len(requests)),
        "load_time_s": {name: llm.load_time_s for name, llm in llms.items()},
        "notes": skipped + [f"{n}: benched in a process of its own, since its runtime keeps what each "
                              f"new shape allocated" for n, llm in llms.items() if isinstance(llm, IsolatedLine)],
        "baseline_missing": no_baseline,
    }
    res["roofline"] = _roofline(cost, b, pceil, ceil, served)
    if chunked:
        res["chunked"] = chunked
        res["chunked_long_prompt"] = max(b.prompt_lens)
    return res


def _roofline(cost, b, pceil, ceil, served: dict[str, Any]) -> dict[str, Any]:
    """Each phase's arithmetic intensity and bound (on the ceilings of the engine it ran on:
    pceil prefill's, ceil decode's), and what speculation did to decode's."""
    big = max(b.prompt_lens)
    out = {
        "prefill_intensity": cost.prefill(big, b.cache_depth).intensity, "prefill_intensity_at": big,
        "decode_intensity_b1": cost.decode(1, b.decode_context).intensity,
        "decode_intensity": {str(x): cost.decode(x, b.decode_context).intensity for x in b.batch_sizes},
        "decode_crossover_batch": cost.decode_crossover(b.decode_context, ceil.peak_flops, ceil.bandwidth),
        "prefill_bound_tokens_per_s": {str(n): n / cost.prefill(n, b.cache_depth).bound_s(
            pceil.peak_flops, pceil.bandwidth) for n in b.prompt_lens},
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
    from twophase.core.sampling_params import SamplingParams

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
    gaps = sorted((b - start, b - a) for r in shorts
                  for a, b in zip(r.times.token_times, r.times.token_times[1:]))
    out["itl_timeline"] = [g for _, g in gaps]
    out["itl_timeline_at_s"] = [t for t, _ in gaps]        # when each gap ended, from the start
    out["long_prompt_arrival_s"] = long.times.arrival - start
    out["long_prompt_first_token_s"] = long.times.token_times[0] - start
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
