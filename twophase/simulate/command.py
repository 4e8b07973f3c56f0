"""``twophase simulate``'s arguments and command (light to import: the CLI builds its parser
from it before anything heavy loads)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from twophase.cli import flags, terminal

log = logging.getLogger("twophase")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add(p, prompts=False)
    p.add_argument("--device", default="cpu",
                   help="cpu (this machine's calibration) or a GPU by name: h100-80gb, h100-94gb, "
                        "h200, a100-80gb, a100-40gb, l40s, l4")
    p.add_argument("--rate", type=float, help="requests/s, Poisson arrivals (default: "
                                              "bench.serving.rate; none: all at once)")
    p.add_argument("--requests", type=int, help="synthetic requests (default: bench.serving.num_requests)")
    p.add_argument("--prompt-len", metavar="DIST", help="prompt tokens: N or MIN-MAX, uniform "
                                                        "(default: bench.serving.input_len)")
    p.add_argument("--output-len", metavar="DIST", help="output tokens: N or MIN-MAX, uniform "
                                                        "(default: bench.serving.output_len)")
    p.add_argument("--workload", metavar="FILE.jsonl",
                   help='a trace: {"prompt_token_ids": [...], "max_tokens": N, "arrival_s": T} a line')
    p.add_argument("--seed", type=int, help="the synthetic workload's seed")
    p.add_argument("--slo", help="SLOs for goodput, seconds: ttft=2,tpot=0.1 (and e2e=...)")
    p.add_argument("--json", metavar="FILE", help="write the report, the simulation's figures and steps")
    p.add_argument("--plot", metavar="FILE", help="a PNG: latency CDFs and KV occupancy over time")
    p.add_argument("--search", action="append", metavar="KEY=V1,V2,...",
                   help="simulate every combination and rank by goodput (repeatable), e.g. "
                        "scheduler.max_num_seqs=16,32,64")
    p.add_argument("--acceptance", type=float, default=0.7,
                   help="with speculative.method = \"ngram\": the chance each drafted token is kept "
                        "(the workload's; default 0.7)")
    p.add_argument("--tp", type=int, default=1,
                   help="each engine spans this many GPUs, tensor-parallel (all-reduces costed over "
                        "the device's link)")
    p.add_argument("--link-gbps", type=float, metavar="GB/s",
                   help="the link between devices, GB/s each way (default: the device's NVLink or "
                        "PCIe; between nodes, e.g. 50 for 400 Gb/s InfiniBand)")
    p.add_argument("--fit", action="store_true",
                   help="cpu: fit the efficiencies to the config's backend on this machine first "
                        "(a short profiling sweep, cached a backend)")


def cmd_simulate(args: argparse.Namespace) -> int:

    from twophase.cli.phase_table import phase_table
    from twophase.config import load_config
    from twophase.core.metrics import step_dicts
    from twophase.simulate import driver, fleet, report, search
    from twophase.simulate.devices import check_tp, device_spec, fitted_backend, with_link
    from twophase.simulate.engine import for_device

    if args.config and not Path(args.config).is_file() and args.model is None:
        args.model, args.config = args.config, None          # CONFIG may name a model or shape
    data = {}
    if args.config:
        from twophase.cli.flags import tomllib

        data = tomllib.loads(Path(args.config).read_text(encoding="utf-8-sig"))
    base = flags.overrides(args, data)
    cfg = flags.load(args)
    slo = report.parse_slo(args.slo)
    console = terminal.console()
    check_tp(args.tp, args.device)            # before a CPU's calibration is measured
    if args.fit:
        from twophase.simulate import fit

        fit.fit_cpu(cfg, console)
    from twophase.plan.budget import model_dtype

    device = with_link(device_spec(args.device, model_dtype(cfg, "cpu" if args.device == "cpu" else "cuda"),
                                   fitted_backend(cfg), cfg.model.quantization), args.link_gbps)
    s = cfg.bench.serving
    prompt_len = driver.parse_range(args.prompt_len, "--prompt-len") if args.prompt_len else s.input_len
    output_len = driver.parse_range(args.output_len, "--output-len") if args.output_len else s.output_len
    rate = args.rate if args.rate is not None else s.rate
    n = args.requests if args.requests is not None else s.num_requests
    seed = args.seed if args.seed is not None else s.seed
    trace = args.workload or s.jsonl

    def simulate(overrides: dict) -> dict:
        merged = search.merge(base, overrides)
        c = load_config(args.config, merged) if args.config else load_config(None, merged)
        f = fleet.Fleet(c, device, acceptance=args.acceptance, tp=args.tp)
        reqs = driver.workload(n, rate, prompt_len, output_len, f.model.arch.vocab_size, seed, trace)
        out = report.simulation_report(f, fleet.drive(f, reqs), slo)
        out["steps"] = step_dicts(f.steps)
        return out

    if args.search:
        rows = search.search(search.parse(args.search), simulate)
        console.print(search.table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": args.device, "search": rows}, indent=2, default=str))
            console.print(f"wrote {args.json}")
        best = rows[0] if rows and "error" not in rows[0] else None
        if args.plot and best is not None:      # the best-ranked settings, simulated again (seeded)
            path = report.plot(simulate(search.overrides(best["settings"])), Path(args.plot))
            console.print(f"wrote {path} (#1: {', '.join(f'{k}={v}' for k, v in best['settings'].items())})")
        return 0
    for_device(cfg, device)                   # refuses what the simulator does not model, early
    result = simulate({})
    console.print(phase_table(result["report"]))
    console.print(report.simulation_table(result["simulation"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        console.print(f"wrote {args.json}")
    if args.plot:
        console.print(f"wrote {report.plot(result, Path(args.plot))}")
    return 0
