"""Predicted against measured: the default model on the torch, onnxruntime and native (q4)
backends on this CPU, three serving workloads each, run for real and simulated (``twophase
simulate --device cpu`` with that backend's fitted figures), side by side: output throughput,
TTFT p50, TPOT p50 and preemptions, and which agree within 10% (throughput) and 15% (latency).

    python benchmarks/simulate_vs_real.py [--backend torch,onnxruntime,native]
        [--workload steady,bursts,shared] [--repeats N] [--no-fit] [--num-blocks N] [--json FILE]

Workloads (each sized to take about a minute for real here):

- steady: Poisson arrivals, prompts 64-256 tokens, outputs 32-64
- bursts: bursts of long prompts (1024-1536 tokens, outputs 16-32) arriving together
- shared: one 512-token system prompt before each prompt's own 32-64 tokens, Poisson, outputs 32

Each backend runs in a process of its own (its fit, then its real runs, a fresh engine each),
so one backend's threads and memory do not weigh on another's measurements; the simulations
run here afterwards, over the real engine's pool size. By default each backend's efficiencies
are fitted first (``twophase simulate --fit``: a short profiling sweep, cached a backend). The
machine is shared: other processes' load moves both the fit and the real runs, so each figure
is one sample of the machine as it was (every run records the load and others' CPU share);
``--repeats N`` serves each workload N times for real (rounds interleaved across the
workloads, a fresh engine each) and compares the simulation with the runs' median, beside their
spread (the simulation is deterministic: one run of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from twophase.bench.serving import TimedRequest
from twophase.config import Config, load_config

BACKENDS: dict[str, dict[str, Any]] = {
    "torch": {"backend": {"name": "torch"}},
    "onnxruntime": {"backend": {"name": "onnxruntime"}},
    "native": {"backend": {"name": "native"}, "model": {"quantization": "q4"}},   # runs q4 or gguf only
}
WORKLOADS = ("steady", "bursts", "shared")
THROUGHPUT_TOLERANCE, LATENCY_TOLERANCE = 0.10, 0.15


def workload(name: str, vocab: int, seed: int = 0) -> list[TimedRequest]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if name == "steady":                  # 40 requests at 0.6/s
        from twophase.simulate import driver

        return driver.workload(40, 0.6, [64, 256], [32, 64], vocab, seed)
    if name == "bursts":                  # 3 bursts of 3, 20 s apart
        return [TimedRequest(20.0 * b, tokens(rng.randint(1024, 1536)), rng.randint(16, 32))
                for b in range(3) for _ in range(3)]
    if name == "shared":                  # 40 requests at 0.8/s over one system prompt
        system, t, out = tokens(512), 0.0, []
        for _ in range(40):
            out.append(TimedRequest(t, system + tokens(rng.randint(32, 64)), 32))
            t += rng.expovariate(0.8)
        return out
    raise ValueError(f"no workload {name!r}; known: {', '.join(WORKLOADS)}")


def backend_config(backend: str, num_blocks: int | None = None, prefault: bool = False) -> Config:
    data = json.loads(json.dumps(BACKENDS[backend]))
    cache: dict[str, Any] = {"prefault": prefault}
    if num_blocks is not None:
        cache["num_blocks"] = num_blocks
    return load_config({**data, "cache": cache})


def measure(backend: str, workloads: dict[str, list[TimedRequest]], fit: bool,
            num_blocks: int | None, repeats: int = 1) -> dict[str, Any]:
    """In a process of its own: the backend's fit, then each workload served for real on a
    fresh engine (after a warm-up), ``repeats`` rounds over the workloads, with how busy the
    machine was meanwhile."""
    from twophase.llm import LLM
    from twophase.measure import machine
    from twophase.simulate import driver

    console = Console(width=200)
    cfg = backend_config(backend, num_blocks, prefault=True)   # no first-touch pages in a run
    if fit:
        from twophase.simulate.fit import fit_cpu

        a = machine.sample()
        fit_cpu(cfg, console)
        fit_machine = machine.between(a, machine.sample())
    out: dict[str, Any] = {"fit_machine": fit_machine if fit else None, "runs": {name: [] for name in workloads}}
    with LLM(cfg) as llm:
        out["num_blocks"], out["model"] = llm.num_blocks, llm.model.model_id
        driver.drive(llm.engine, driver.workload(4, None, [256, 256], [8, 8], llm.model.arch.vocab_size, 99),
                     time.perf_counter, time.sleep)
        for i in range(repeats):
            for name, reqs in workloads.items():
                llm.engine = llm.build_engine()              # an empty prefix cache and step record
                a = machine.sample()
                run = driver.drive(llm.engine, [dataclasses.replace(r) for r in reqs], time.perf_counter, time.sleep)
                m = machine.between(a, machine.sample())
                out["runs"][name].append({"report": llm.report(run.outputs), "host_s": run.host_s,
                                          "rejected": len(run.rejected), "machine": m})
                console.print(f"{backend} {name} ({i + 1} of {repeats}): {run.host_s:.1f} s for real (load "
                              f"{m['load_before']:.2f} -> {m['load_after']:.2f}, others' CPU "
                              f"{100 * (m['others_cpu_fraction'] or 0):.0f}%)")
    return out


def figure(report: dict[str, Any], key: str) -> float:
    """A report's throughput, or a latency's p50."""
    v = report[key]
    return v["p50"] if isinstance(v, dict) else v


def median_report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' median of each figure the table compares, and their spread."""
    from statistics import median

    out: dict[str, Any] = {"spread": {}}
    for key in ("output_tokens_per_s", "ttft_s", "tpot_s"):
        vals = [figure(r["report"], key) for r in runs]
        out[key] = median(vals)
        out["spread"][key] = (min(vals), max(vals))
    out["preemptions"] = median(r["report"]["preemptions"] for r in runs)
    return out


def ratio(m: float, s: float) -> float | None:
    return s / m if m else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", action="append", help="torch, onnxruntime, native (repeatable or a "
                                                      "comma list; default all three)")
    p.add_argument("--workload", action="append", help="steady, bursts, shared (repeatable or a comma "
                                                       "list; default all three)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, help="the KV pool's blocks, real and simulated (default: auto)")
    p.add_argument("--repeats", type=int, default=1, help="real runs of each workload (the median is compared)")
    p.add_argument("--no-fit", action="store_true", help="use the cached (or default) CPU efficiencies")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    backends = [b for v in args.backend or [",".join(BACKENDS)] for b in v.split(",") if b]
    names = [w for v in args.workload or [",".join(WORKLOADS)] for w in v.split(",") if w]
    for b in backends:
        if b not in BACKENDS:
            p.error(f"--backend: no {b!r}; known: {', '.join(BACKENDS)}")
    for w in names:
        if w not in WORKLOADS:
            p.error(f"--workload: no {w!r}; known: {', '.join(WORKLOADS)}")

    import torch

    from twophase.bench.calibrate import ceilings
    from twophase.plan.model_source import planned_model
    from twophase.simulate import simulate
    from twophase.simulate.devices import cpu_spec, fitted_backend

    console = Console(width=200)
    cal = ceilings("cpu", torch.float32)
    console.print(f"calibration: {cal.peak_flops / 1e9:.0f} GFLOP/s, {cal.bandwidth / 1e9:.1f} GB/s "
                  f"({cal.measured_at}, {cal.threads} threads)")
    vocab = planned_model(backend_config(backends[0]).model).arch.vocab_size
    workloads = {w: workload(w, vocab, args.seed) for w in names}
    rows: list[dict[str, Any]] = []
    fits: dict[str, Any] = {}
    for b in backends:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            real = pool.submit(measure, b, workloads, not args.no_fit, args.num_blocks, args.repeats).result()
        cfg = backend_config(b, real["num_blocks"])       # the real engine's pool
        device = cpu_spec("float32", fitted_backend(cfg), cfg.model.quantization)
        fits[b] = {**device.__dict__, "fit_machine": real["fit_machine"]}
        console.print(f"{b}: compute efficiency {device.compute_efficiency:.2f}, bandwidth efficiency "
                      f"{device.bandwidth_efficiency:.2f}, {device.step_overhead_s * 1e3:.1f} ms a step "
                      f"({device.source})")
        for w, reqs in workloads.items():
            sim = simulate(cfg, device, reqs)
            runs = real["runs"][w]
            rows.append({"backend": b, "workload": w, "model": real["model"], "measured": median_report(runs),
                         "simulated": sim["report"], "real_runs": runs,
                         "real_host_s": sum(r["host_s"] for r in runs) / len(runs),
                         "others_cpu": max((r["machine"].get("others_cpu_fraction") or 0.0) for r in runs),
                         "simulation": {k: v for k, v in sim["simulation"].items() if k != "timeline"}})

    repeats = f"; measured: the median of {args.repeats} runs (their range below it)" if args.repeats > 1 else ""
    t = Table(title=f"simulated vs measured on this CPU: {rows[0]['model'] if rows else ''}; ok: throughput "
                    f"within {THROUGHPUT_TOLERANCE:.0%}, latencies within {LATENCY_TOLERANCE:.0%}{repeats}")
    for col in ("backend", "workload", "out tok/s meas", "sim", "ratio", "TTFT p50 ms meas", "sim", "ratio",
                "TPOT p50 ms meas", "sim", "ratio", "preempt meas", "sim", "real s", "others' CPU"):
        t.add_column(col, justify="right")
    for r in rows:
        m, s = r["measured"], r["simulated"]
        cells = []
        for key, scale, fmt, tol in (("output_tokens_per_s", 1.0, "{:.1f}", THROUGHPUT_TOLERANCE),
                                     ("ttft_s", 1e3, "{:.0f}", LATENCY_TOLERANCE),
                                     ("tpot_s", 1e3, "{:.1f}", LATENCY_TOLERANCE)):
            mv, sv = m[key], figure(s, key)
            lo, hi = m["spread"][key]
            q = ratio(mv, sv)
            r.setdefault("ratios", {})[key] = q
            r.setdefault("within", {})[key] = q is not None and abs(q - 1) <= tol
            r.setdefault("inside_real_range", {})[key] = lo <= sv <= hi
            spread = f"\n{fmt.format(lo * scale)}-{fmt.format(hi * scale)}" if args.repeats > 1 else ""
            cells += [fmt.format(mv * scale) + spread, fmt.format(sv * scale),
                      "-" if q is None else f"{q:.2f} {'ok' if abs(q - 1) <= tol else 'x'}"]
        t.add_row(r["backend"], r["workload"], *cells, f"{m['preemptions']:g}", str(s["preemptions"]),
                  f"{r['real_host_s']:.0f}", f"{100 * r['others_cpu']:.0f}%")
    console.print(t)
    met = sum(all(r["within"].values()) for r in rows)
    console.print(f"{met} of {len(rows)} runs meet every target. The machine is shared with other work: "
                  f"both the fit and the real runs move with its load.")
    if args.repeats > 1:
        inside = sum(v for r in rows for v in r["inside_real_range"].values())
        console.print(f"{inside} of {3 * len(rows)} simulated figures lie within their real runs' range.")
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": cal.__dict__, "fits": fits, "runs": rows},
                                              indent=2, default=str))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
