"""twophase: run a config, chat with its model, serve it over HTTP, benchmark backends, list
backends, export models, manage the cache.

User mistakes end in one message (exit status 2 for config errors), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from twophase.cli import flags, terminal
from twophase.cli.cache_contents import KINDS
from twophase.errors import ConfigError, TwophaseError, install_hint

log = logging.getLogger("twophase")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twophase", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"twophase {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a config's workload and print completions and a phase report")
    flags.add(run)
    run.add_argument("--json", metavar="FILE", help="write completions, report and steps as JSON")
    run.add_argument("--quiet", action="store_true", help="report only, no completions")
    backends = sub.add_parser("backends", help="list registered backends and whether they can run here; "
                                               "with a config or --model, what backend auto chose from")
    flags.add(backends, prompts=False)
    backends.add_argument("--recalibrate", action="store_true", help="time the backends again")
    exp = sub.add_parser("export", help="export a config's model to a compiled format (cached)")
    exp.add_argument("config", help="TOML file")
    exp.add_argument("--format", choices=["onnx", "mlir", "tensorrt"], default="onnx",
                     help="onnx: the step graph; mlir: an IREE module for the config's block size; "
                          "tensorrt: an engine for this GPU with prefill and decode profiles")
    exp.add_argument("--out", metavar="DIR", help="folder (default: under $TWOPHASE_CACHE)")
    exp.add_argument("--force", action="store_true", help="export again even if up to date")
    bench = sub.add_parser("bench", help="compare backends phase by phase and on a serving "
                                         "workload, against the roofline (tables, JSON, Markdown, plots)")
    bench.add_argument("config", help="TOML file; its [bench] section sets the sweeps")
    bench.add_argument("--backends", help="comma list (default: bench.backends)")
    bench.add_argument("--out", metavar="DIR", default="bench-results",
                       help="where results.json, report.md and the plots go (default: %(default)s)")
    bench.add_argument("--speculative", action="store_true",
                       help="also serve the workload with speculative decoding (the config's "
                            "[speculative], else n-gram with num_tokens = auto) on the first "
                            "backend, beside the same run without")
    bench.add_argument("--compare-chunked", action="store_true",
                       help="also run a long prompt among running decodes with chunked prefill "
                            "on and off, and show the inter-token latency spike without it")
    chat = sub.add_parser("chat", help="talk to the model in the terminal, answers streamed")
    flags.add(chat, prompts=False)
    serve = sub.add_parser("serve", help="serve the config's model over an OpenAI-compatible HTTP API")
    flags.add(serve, prompts=False)
    serve.add_argument("--host", help="default: server.host (127.0.0.1)")
    serve.add_argument("--port", type=int, help="default: server.port (8000)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: "
                                         "server.api_key or $TWOPHASE_API_KEY)")
    ray = serve.add_argument_group(f"on Ray ({install_hint('cluster')}; docs/cluster.md)")
    ray.add_argument("--replicas", type=int, help="engine replicas behind the endpoint (cluster.replicas)")
    ray.add_argument("--prefill-workers", type=int, help="disaggregated: prefill workers "
                                                         "(cluster.prefill_workers)")
    ray.add_argument("--decode-workers", type=int, help="disaggregated: decode workers "
                                                        "(cluster.decode_workers)")
    cal = sub.add_parser("calibrate", help="measure (and cache) this device's matmul peak and "
                                           "memory bandwidth, the roofline's ceilings")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "int8"],
                     help="one engine (default: on a CPU every one it has, float32 on CUDA)")
    cal.add_argument("--force", action="store_true", help="measure again even if cached")
    plan = sub.add_parser("plan", help="what a config needs in memory on a device, before anything "
                                       "loads: weights, KV cache, activations...; users that fit")
    flags.add(plan, prompts=False)
    plan.add_argument("--device", default="cpu",
                      help="cpu or cuda (this machine, free memory now), or a GPU by name: "
                           "h200, h100-80gb, a100-80gb, a100-40gb, l40s, l4, a10g, rtx-4090")
    plan.add_argument("--memory-gb", type=float, help="the device's memory instead of its own")
    plan.add_argument("--context", type=int, help="tokens per request for the concurrency figures "
                                                  "(default: max_model_len)")
    plan.add_argument("--users", type=int, help="requests at once: do they fit?")
    plan.add_argument("--json", metavar="FILE", help="write every figure, in bytes")
    plan.add_argument("--plot", metavar="FILE", default="memory-plan.png",
                      help="the stacked bar and concurrency curve (default: %(default)s; '' for none)")
    sim = sub.add_parser("simulate", help="the engine's scheduler on a virtual clock: latency, throughput "
                                          "and goodput of a config on a device, before renting it")
    from twophase.simulate.command import add_arguments, cmd_simulate
    add_arguments(sim)
    cache = sub.add_parser("cache", help="what $TWOPHASE_CACHE holds, with sizes; clear parts of it")
    cache.add_argument("action", nargs="?", choices=["list", "clear"], default="list")
    cache.add_argument("kinds", nargs="*", metavar="KIND",
                       help=f"clear: what to delete ({', '.join(KINDS)})")
    cache.add_argument("--all", action="store_true", help="clear: every kind")
    cache.add_argument("--kv-dir", metavar="DIR", help="the K/V disk tier at DIR (cache.offload.disk_dir) "
                                                       "instead: its blocks by model fingerprint; clear deletes them")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    commands = {"run": cmd_run, "export": cmd_export, "bench": cmd_bench, "calibrate": cmd_calibrate,
                "serve": cmd_serve, "chat": cmd_chat, "cache": cmd_cache, "plan": cmd_plan,
                "simulate": cmd_simulate}
    try:
        if args.command in commands:
            return commands[args.command](args)
        return cmd_backends(args)
    except ConfigError as exc:
        print(f"twophase: config error: {exc}", file=sys.stderr)
        return 2
    except TwophaseError as exc:
        print(f"twophase: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("twophase")
    except PackageNotFoundError:          # run from a source tree that is not installed
        return "unknown (not installed)"


def cmd_run(args) -> int:
    from twophase.cli import workload

    cfg = flags.load(args)          # before torch is imported: config errors come at once
    workload.validate(cfg)
    from twophase.llm import LLM

    with LLM(cfg) as llm:
        return _run_and_report(args, cfg, llm)


def _run_and_report(args, cfg, llm) -> int:

    from twophase.cli import workload
    from twophase.cli.phase_table import phase_table
    from twophase.core.metrics import step_dicts

    items = workload.build(cfg, llm.tokenizer, llm.model.arch.vocab_size)
    outputs = llm.generate([p for p, _ in items], [s for _, s in items], use_tqdm=True)
    console = terminal.console()
    if not args.quiet:
        for i, o in enumerate(outputs):
            shown = o.text if llm.tokenizer is not None else str(o.token_ids)
            if o.finish_reason == "rejected":
                console.print(terminal.styled((f"#{i} rejected:", "bold red"), " ", o.error or ""))
            else:
                console.print(terminal.styled((f"#{i}", "bold"), " ",
                                              (f"({o.finish_reason}, {len(o.token_ids)} tokens)", "dim"), " ", shown))
    report = llm.report(outputs)
    console.print(phase_table(report))
    if args.json:
        data = {"config": str(Path(args.config).resolve()) if args.config else None, "report": report,
                "outputs": [{k: v for k, v in o.__dict__.items() if k != "times"} for o in outputs],
                "steps": step_dicts(llm.engine.step_records())}
        Path(args.json).write_text(json.dumps(data, indent=2, default=str))
        log.info("wrote %s", args.json)
    return 0


def cmd_bench(args) -> int:
    from twophase.config import load_config

    cfg = load_config(args.config)

    from twophase.bench import run as bench
    from twophase.bench.report import print_tables

    names = [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends else None
    if names is not None and not names:
        raise ConfigError("--backends", "name at least one backend")
    res = bench.run(cfg, names, args.compare_chunked, bench.command_line(args.argv), args.speculative)
    print_tables(res, terminal.console())
    for path in bench.write(res, args.out):
        log.info("wrote %s", path)
    return 0


def cmd_serve(args) -> int:
    import os

    from twophase.server.serve import AppFactory, local_app, serve

    cfg = flags.load(args)
    sv = cfg.server
    key = args.api_key or sv.api_key or os.environ.get("TWOPHASE_API_KEY")
    make_app: AppFactory = local_app           # one engine in this process
    if cfg.cluster.enabled:                     # engines on Ray behind the same app
        from twophase.cluster.app import cluster_app
        make_app = cluster_app
    return serve(cfg, args.host or sv.host, args.port if args.port is not None else sv.port, key,
                 make_app)


def cmd_chat(args) -> int:
    from twophase.cli import workload
    from twophase.cli.chat import chat
    from twophase.llm import LLM

    cfg = flags.load(args)
    params = workload.sampling_params(cfg)
    with LLM(cfg) as llm:
        return chat(llm, params)


def cmd_plan(args) -> int:

    from twophase import plan as planner
    from twophase.backends.registry import Registry
    from twophase.plan import render

    for flag in ("context", "users"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag}", f"must be a positive integer; got {v}")
    device = planner.profile(args.device, args.memory_gb)
    cfg = flags.load(args)
    if device.kind == "cuda":                 # plan for the GPU whatever device the config names
        cfg = flags.on_device(cfg, "cuda")
    registry = Registry()
    cfg, routed, note = _plan_routing(cfg, device, registry)
    p = planner.plan(cfg, device, args.context, args.users, routed=routed, registry=registry)
    if note:
        p.notes.insert(0, note)
    console = terminal.console()
    console.print(render.table(p))
    for line in render.summary(p):
        console.print(line, highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(p.to_dict(), indent=2))
        console.print(f"wrote {args.json}")
    if args.plot:
        try:
            console.print(f"wrote {render.plot(p, Path(args.plot))}")
        except ImportError:
            console.print(f"no plot: matplotlib is not installed ({install_hint('bench')})")
    return 0 if p.fits else 1


def _plan_routing(cfg, device, registry):
    """``[backend] name = "auto"`` as it was timed on this machine (if it was, and the plan is for
    this machine), else on torch with a note saying so."""
    from twophase.builder import routing

    if not routing.wanted(cfg):
        return cfg, (), None
    here = device.source.startswith("free on this machine")
    try:
        r = routing.cached(cfg, registry) if here else None
    except ConfigError:
        r = None
    if r is not None:
        return routing.apply(cfg, r), tuple(n for _, n in r.routes), f"backend auto: {r.describe()}"
    why = "not timed on this machine yet (twophase backends CONFIG times it)" if here else \
        f"timed only on the machine it runs on, not for {device.name}"
    return (routing.apply(cfg, routing.Routing("torch", "torch")), (),
            f"backend auto is {why}: planned on torch")


def _kv_tier(args) -> int:
    """``twophase cache [clear] --kv-dir DIR``: the disk tier's blocks, a folder a fingerprint."""
    from rich.table import Table

    from twophase.cache.disk_tier import clear_root, folders
    from twophase.cli import cache_contents as cc

    if args.action == "clear":
        print(f"removed {clear_root(args.kv_dir)} K/V blocks from {args.kv_dir}")
        return 0
    found = folders(args.kv_dir)
    t = Table(title=f"K/V disk tier {args.kv_dir}: {cc.human(sum(f.bytes for f in found))}")
    for col in ("fingerprint", "blocks", "size"):
        t.add_column(col, justify="left" if col == "fingerprint" else "right")
    for f in found:
        t.add_row(f.name, str(f.files), cc.human(f.bytes))
    terminal.console().print(t if found else f"{args.kv_dir} holds no K/V blocks")
    return 0


def cmd_cache(args) -> int:
    from rich.table import Table

    from twophase.cli import cache_contents as cc
    from twophase.paths import cache_dir

    if args.kv_dir:
        return _kv_tier(args)
    root = cache_dir()
    if args.action == "clear":
        kinds = list(KINDS) if args.all else args.kinds
        wrong = [k for k in kinds if k not in KINDS]
        if not kinds or wrong:
            raise ConfigError("cache clear", f"name what to clear ({', '.join(KINDS)}) or --all"
                              + (f"; not a kind: {wrong[0]!r}" if wrong else ""))
        print(f"freed {cc.human(cc.clear(root, kinds))} from {root} ({', '.join(kinds)})")
        return 0
    found = cc.entries(root)
    t = Table(title=f"{root}: {cc.human(sum(e.bytes for e in found))}")
    for col in ("kind", "entry", "size", "last written"):
        t.add_column(col, justify="right" if col == "size" else "left", overflow="fold")
    for e in found:
        t.add_row(e.kind, e.name + ("" if e.complete else " (incomplete build)"), cc.human(e.bytes),
                  cc.age(e.modified))
    console = terminal.console()
    console.print(t if found else f"{root} is empty")
    for kind, what in KINDS.items():
        total = sum(e.bytes for e in found if e.kind == kind)
        if total:
            console.print(f"  {kind}: {what}, {cc.human(total)}")
    if cc.unknown(root):
        console.print(f"  not twophase's, left alone: {', '.join(cc.unknown(root))}")
    console.print("Everything here is rebuilt when needed; `twophase cache clear KIND` or "
                  "`--all` deletes it.")
    return 0


def cmd_calibrate(args) -> int:
    import torch

    from twophase.bench.calibrate import ceilings

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError("--device", f"{args.device!r} is not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{args.device!r}: torch {torch.__version__} sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("--device", f"calibration measures cpu or cuda devices, not {args.device!r}")
    from twophase.bench.calibrate import cpu_engines

    engines = cpu_engines() if device.type == "cpu" else {}
    dtypes = [getattr(torch, args.dtype)] if args.dtype else list(engines) or [torch.float32]
    for dtype in dtypes:
        try:
            c = ceilings(device, dtype, force=args.force)
        except (RuntimeError, NotImplementedError) as exc:     # an engine this torch cannot time
            print(f"{str(dtype).removeprefix('torch.')}: not measured (torch {torch.__version__}: {exc})")
            continue
        unit = "GOP/s" if dtype == torch.int8 else "GFLOP/s"
        isa = f" on {', '.join(engines[dtype])}" if engines.get(dtype) else ""
        print(f"{c.device} ({c.dtype}{isa}, {c.threads or 'all'} threads): matmul peak "
              f"{c.peak_flops / 1e9:.1f} {unit}, memory bandwidth {c.bandwidth / 1e9:.1f} GB/s, "
              f"ridge {c.ridge:.1f} {'OP' if dtype == torch.int8 else 'FLOP'}/byte")
        print(f"  measured {c.measured_at}; best runs within {100 * max(c.peak_spread, c.bandwidth_spread):.1f}%")
        for why in c.busy:
            print(f"  warning: the machine was not quiet while calibrating: {why}")
    return 0


def cmd_backends(args) -> int:
    from rich.table import Table

    from twophase.arch import FEATURES
    from twophase.backends.registry import Registry

    reg = Registry()
    notes: list[str] = []
    table = Table(title="twophase backends")
    for col in ("name", "source", "weights", "K/V", "cpu", "cuda"):
        table.add_column(col)
    for name, info in sorted(reg.backends.items()):
        cells = []
        for device in ("cpu", "cuda"):
            why = reg.availability(name, device)
            yes, no = ("yes", "green"), ("no", "red")
            try:                                 # a plugin's statement is its own business
                here = info.cls.engines_here(device) if why is None else None
            except Exception as exc:
                here = f"? ({type(exc).__name__})"
            cells.append(terminal.styled(yes, *([f": {here}"] if here else [])) if why is None
                         else terminal.styled(no, ": ", why))
        try:
            caps = info.cls().capabilities()     # the class's own statement: nothing is loaded
            kv = ", ".join(dict.fromkeys([str(d).removeprefix("torch.") for d in caps.dtypes] + list(caps.kv_formats)))
            notes += [f"{name}: {FEATURES.get(f, f)}: {how}" for f, how in caps.computes.items()]
        except Exception as exc:                 # a plugin's constructor is its own business
            kv = f"? ({type(exc).__name__})"
        table.add_row(name, info.source, ", ".join(info.cls.quantizations), kv, *cells)
    for info in reg.failures:
        table.add_row(info.name, info.source, "", "", terminal.styled(("failed to load", "red"), ": ", info.error), "")
    console = terminal.console()
    console.print(table)
    for note in notes:                           # how a backend computes what it claims, where that costs
        console.print(note)
    if args.config or args.model or args.quantization:
        _print_routing(console, reg, args)
    return 0


def _print_routing(console, reg, args) -> None:
    """What ``[backend] name = "auto"`` measured for the config's model here, and chose."""
    import dataclasses

    from rich.table import Table

    from twophase.builder import routing
    from twophase.llm import LLM

    cfg = flags.load(args)
    if not routing.wanted(cfg):
        b = cfg.backend
        cfg = dataclasses.replace(cfg, backend=dataclasses.replace(b, name="auto", options={}, prefill=None,
                                                                   decode=None))
    r = routing.resolve(cfg, reg, make_engine=LLM, recalibrate=args.recalibrate)
    rows = routing.table_rows(r)
    if rows:
        t = Table(title=f"{cfg.model.name} ({cfg.model.quantization}), tokens/s here: prefill of "
                        f"{r.table['prefill_tokens']} tokens; decode at batch 1, 2, ... (context {r.table['context']})")
        header = rows[0]
        for col in (header[0], header[1], *header[2]):
            t.add_column(col, justify="right")
        for name, prefill, decode in rows[1:]:
            t.add_row(name, prefill, *decode)
        console.print(t)
    for name, why in r.table.get("left_out", {}).items():
        console.print(f"left out: {name}: {why}")
    if r.table.get("busy"):
        why = "; ".join(r.table["busy"])
        console.print(terminal.styled(("measured on a busy machine", "bold yellow"),
                                      f" ({why}): not cached; run this again on a quiet machine"))
    console.print(f"auto: {r.describe()}")


def cmd_export(args) -> int:
    from twophase.config import load_config

    cfg = load_config(args.config)
    from twophase.models import loader

    m = loader.resolve(cfg.model.source(), "cpu")     # exporting never needs a GPU (TensorRT aside)
    spec = loader.model_spec(m, cfg.model.source())
    if args.format == "onnx":
        from twophase.exporters import onnx

        path = onnx.export(spec, args.out, force=args.force)
    elif args.format == "mlir":
        from twophase.backends.iree import IreeBackend
        from twophase.exporters import mlir

        IreeBackend.check_available("cpu")
        path = mlir.export(spec, "cpu", cfg.cache.block_size, args.out, force=args.force)
    else:
        path = _build_tensorrt_engine(cfg, args)
    print(path)
    return 0


def _build_tensorrt_engine(cfg, args) -> Path:
    """The engine's profiles depend on the pool's size, which only loading the config fixes:
    load it with the tensorrt backend (building the engine on the way)."""
    from dataclasses import replace

    from twophase.config import BackendSection
    from twophase.llm import LLM

    device = cfg.phases()[0].device
    options = {"engine_dir": args.out} if args.out else {}
    if args.force:
        options["rebuild"] = True
    section = BackendSection(name="tensorrt", device=device if device != "cpu" else "cuda",
                             options=options)
    llm = LLM(replace(cfg, backend=section))
    return llm.prefill_backend.engine_path
