"""Prefill and decode measured apart, llama-bench style, on any shape/device/dtype.

Prefill: one prompt of each length a round, timed as its pure-prefill step (the budget is raised
to the prompt length, so each prompt is one step). Decode: B sequences at a given context length,
timed as the median pure-decode step with all B running. The rounds are ``twophase.bench.sweeps``'s
(the ones ``twophase bench`` runs on several backends at once); this script runs one backend on
any shape, device and dtype. Random weights by default, so it
runs anywhere without downloads:

    python benchmarks/phase_sweep.py --shape llama3-8b --device cuda --dtype bfloat16
    python benchmarks/phase_sweep.py --model smollm2-135m-instruct      # the default model, CPU
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.bench import sweeps


def build(args, budget: int) -> LLM:
    model = ({"name": args.model} if args.model else
             {"name": args.shape, "weights": "random", "dtype": args.dtype,
              **({"num_layers": args.num_layers} if args.num_layers else {})})
    return LLM.from_config({
        "model": model, "backend": {"name": args.backend, "device": args.device},
        "scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": max(args.batch_sizes),
                      "policy": "prefill-first"},   # all prompts in before decodes start
        "cache": {"memory_gb": args.kv_gb}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a named model (default: random weights of --shape)")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-lens", default="128,512", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch-sizes", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", type=int, default=256, help="context length of decode sequences")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-gb", type=float, default=None, help="KV pool budget")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    budget = max(max(args.prompt_lens), max(args.batch_sizes) + 1)
    llm = build(args, budget)
    rows = []
    for n in args.prompt_lens:                  # one prompt a round: one pure-prefill step
        t = sweeps.spread([sweeps.prefill_round(llm, n, 0, k) for k in range(args.repeats)])["median"]
        rows.append(("prefill", f"{n} tokens", n / t, t * 1e3))
    base = None
    for b in args.batch_sizes:
        t = sweeps.spread([sweeps.decode_round(llm, b, args.context, args.decode_steps, k)
                           for k in range(args.repeats)])["median"]
        base = base or b / t
        rows.append(("decode", f"batch {b} @ ctx {args.context}", b / t, t * 1e3, (b / t) / base))
    table = Table(title=f"{llm.model.model_id} on {args.backend}/{args.device} "
                        f"({str(llm.model.dtype).removeprefix('torch.')}), load {llm.load_time_s:.1f} s")
    for col in ("phase", "shape", "tokens/s", "ms/step", "x batch 1"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.2f}", f"{r[4]:.2f}" if len(r) > 4 else "")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_time_s": llm.load_time_s, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
