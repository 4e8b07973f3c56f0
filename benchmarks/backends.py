"""Backends and phase routings side by side, in one process, interleaved so drift hits all alike.

For each routing (prefill backend → decode backend over one KV pool) it measures prefill
tokens/s of one 512-token prompt (a single pure-prefill step) and decode tokens/s at batch 1 and
32 (pure-decode steps at a 256-token context), each the median of ``--repeats`` rounds taken in
turn across routings. It also prints the KV bytes each decode step gathers from the paged pool
(both backends copy each sequence's blocks once per layer before attending), and the best
routing found. The rounds are ``twophase.bench.sweeps``'s, the ones ``twophase bench`` runs.

    python benchmarks/backends.py                   # default model, CPU
    python benchmarks/backends.py --shape tiny      # random weights of a named shape
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.bench import sweeps


def routings(names: list[str]) -> list[tuple[str, str]]:
    """Each backend alone (the first is the baseline), then every prefill → decode pair."""
    return [(n, n) for n in names] + [(p, d) for p in names for d in names if p != d]


def build(args, prefill: str, decode: str) -> LLM:
    model = {"name": args.shape, "weights": "random"} if args.shape else {}
    backend = {"name": prefill} if prefill == decode else \
        {"prefill": {"name": prefill}, "decode": {"name": decode}}
    return LLM.from_config({"model": model, "backend": backend,
                            "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 64,
                                          # every prompt prefilled before any decode: the
                                          # decode steps then all carry the whole batch
                                          "policy": "prefill-first"},
                            "cache": {"prefix_caching": False, "num_blocks": 1024}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", help="random weights of this shape (default: the default model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backends", default="torch,onnxruntime,iree",
                    help="comma list; those not installed here are skipped")
    args = ap.parse_args()
    console = Console()
    from twophase.backends.registry import Registry

    reg = Registry()
    names = [n for n in args.backends.split(",") if reg.availability(n, "cpu") is None]
    ROUTINGS = routings(names)
    llms = {r: build(args, *r) for r in ROUTINGS}
    cases = [("prefill 512", lambda llm, k: 512 / sweeps.prefill_round(llm, 512, 0, k)),
             ("decode b1", lambda llm, k: 1 / sweeps.decode_round(llm, 1, args.ctx, args.steps, k)),
             ("decode b32", lambda llm, k: 32 / sweeps.decode_round(llm, 32, args.ctx, args.steps, k))]
    results = {r: {name: [] for name, _ in cases} for r in ROUTINGS}
    with console.status("measuring") as status:
        for k in range(args.repeats):
            for name, fn in cases:
                for r, llm in llms.items():        # interleaved: each round visits every routing
                    status.update(f"round {k + 1}/{args.repeats}: {name} on {r[0]} → {r[1]}")
                    results[r][name].append(fn(llm, k))
    base = {name: statistics.median(results[ROUTINGS[0]][name]) for name, _ in cases}
    table = Table(title=f"tokens/s, median of {args.repeats} (ratio to torch → torch)")
    table.add_column("prefill → decode")
    for name, _ in cases:
        table.add_column(name, justify="right")
    for r in ROUTINGS:
        cells = []
        for name, _ in cases:
            v = statistics.median(results[r][name])
            cells.append(f"{v:.1f} (x{v / base[name]:.2f})")
        table.add_row(f"{r[0]} → {r[1]}", *cells)
    console.print(table)
    a = next(iter(llms.values())).model.arch
    blocks = -(-(args.ctx + args.steps) // 16)
    per_step = a.num_layers * 2 * blocks * a.num_kv_heads * 16 * a.head_dim * 4
    console.print(f"KV gathered from the pool per decode step: {per_step / 1e6:.1f} MB per sequence "
                  f"({32 * per_step / 1e6:.0f} MB at batch 32) at context {args.ctx}, fp32")
    score = {r: statistics.median(results[r]["prefill 512"]) / base["prefill 512"]
             + statistics.median(results[r]["decode b32"]) / base["decode b32"] for r in ROUTINGS}
    best = max(score, key=score.get)
    console.print(f"best routing (prefill 512 + decode b32, relative): {best[0]} prefill → {best[1]} decode")


if __name__ == "__main__":
    main()
