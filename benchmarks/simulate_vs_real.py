"""Predicted against measured: one steady serving workload on the default model with the torch
backend on this CPU, run for real and simulated (``twophase simulate --device cpu``), side by
side: output throughput, TTFT p50, TPOT p50.

    python benchmarks/simulate_vs_real.py [--requests 32 --prompt-len 64-256 --output-len 32-64
                                           --rate 0.5] [--no-fit] [--json FILE]

By default the CPU's efficiencies are fitted first (``twophase simulate --fit``: a short
profiling sweep, cached), so the simulation describes this machine as it is now. The machine is
shared: other processes' load moves both the fit and the real run, so the figures are one
sample of a noisy machine, not a benchmark of the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from twophase.config import load_config
from twophase.llm import LLM
from twophase.simulate import driver, simulate
from twophase.simulate.devices import device_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", default="64-256")
    p.add_argument("--output-len", default="32-64")
    p.add_argument("--rate", type=float, default=0.5, help="requests/s, Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fit", action="store_true", help="use the cached (or default) CPU efficiencies")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    console = Console()
    cfg = load_config({"backend": {"name": "torch"}})
    if not args.no_fit:
        from twophase.simulate.fit import fit_cpu

        fit_cpu(cfg, console)
    with LLM(cfg) as llm:
        reqs = driver.workload(args.requests, args.rate, driver.parse_range(args.prompt_len, "--prompt-len"),
                               driver.parse_range(args.output_len, "--output-len"),
                               llm.model.arch.vocab_size, args.seed)
        real_run = driver.drive(llm.engine, reqs, time.perf_counter, time.sleep)
        real = llm.report(real_run.outputs)
    device = device_spec("cpu")
    sim = simulate(cfg, device, reqs)
    predicted, extra = sim["report"], sim["simulation"]
    rows = [("output tokens/s", real["output_tokens_per_s"], predicted["output_tokens_per_s"], 1.0, "{:.1f}"),
            ("TTFT p50 (ms)", real["ttft_s"]["p50"], predicted["ttft_s"]["p50"], 1e3, "{:.0f}"),
            ("TPOT p50 (ms)", real["tpot_s"]["p50"], predicted["tpot_s"]["p50"], 1e3, "{:.0f}"),
            ("E2E p50 (s)", real["e2e_s"]["p50"], predicted["e2e_s"]["p50"], 1.0, "{:.1f}"),
            ("wall time (s)", real["wall_s"], predicted["wall_s"], 1.0, "{:.1f}"),
            ("preemptions", real["preemptions"], predicted["preemptions"], 1.0, "{:.0f}")]
    t = Table(title=f"simulated vs measured: {llm.model.model_id}, torch on this CPU, {args.requests} requests, "
                    f"prompts {args.prompt_len}, outputs {args.output_len}, {args.rate} req/s")
    for col in ("metric", "measured", "simulated", "simulated / measured"):
        t.add_column(col, justify="right")
    for name, m, s, scale, fmt in rows:
        ratio = f"{s / m:.2f}" if m else "-"
        t.add_row(name, fmt.format(m * scale), fmt.format(s * scale), ratio)
    console.print(t)
    d = extra["device"]
    console.print(f"device figures: {d['peak_flops'] / 1e9:.0f} GFLOP/s, {d['bandwidth'] / 1e9:.1f} GB/s, "
                  f"efficiencies {d['compute_efficiency']:.2f} / {d['bandwidth_efficiency']:.2f}, "
                  f"{d['step_overhead_s'] * 1e3:.1f} ms a step ({d['source']})")
    console.print(f"simulation: {extra['simulated_s']:.1f} s simulated in {extra['host_s']:.3f} s "
                  f"({extra['speedup_vs_real_time']:.0f}x real time); the real run took {real_run.host_s:.1f} s. "
                  f"The machine is shared with other work: both figures move with its load.")
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": real, "simulated": predicted,
                                               "simulation": {k: v for k, v in extra.items()
                                                              if k not in ("timeline",)}},
                                              indent=2, default=str))


if __name__ == "__main__":
    main()
