"""Where prefill on AMX tiles starts to pay: tokens/s of one prefill step of N tokens on the
native backend over a GGUF's stored blocks, with the tiles (``backend.options.amx = 1``: any
step) and without (the int8 paths), each line in a process of its own, rounds interleaved.

    python benchmarks/amx_crossover.py [--tokens 8,16,24,32,48,64,128,512] [--rounds 3]
                                       [--model smollm2-135m-instruct] [--gguf FILE]

Each tile step decodes every weight into bf16 once, whatever its rows; the int8 paths read
the blocks as they are. So few rows favour int8, many the tiles: the native backend's default
(``AMX_ROWS``) is where the lines cross on the machine it was measured on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def worker(args) -> dict:
    from twophase import LLM
    from twophase.bench import sweeps

    model = {"path": args.gguf} if args.gguf else {"name": args.model}
    llm = LLM.from_config({"model": {**model, "quantization": "gguf"},
                           "backend": {"name": "native", "options": {"amx": 1 if args.worker == "tiles" else False}},
                           "scheduler": {"max_num_batched_tokens": max(args.tokens)}})
    if args.worker == "tiles":
        assert llm.engine.executor.prefill_backend.amx == 1, "no AMX tiles on this machine"
    out = {}
    for n in args.tokens:
        sweeps.prefill_round(llm, n, 0, 99)                      # warm
        out[n] = n / min(sweeps.prefill_round(llm, n, 0, k) for k in range(3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8,16,24,32,48,64,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--gguf")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from rich.console import Console
    from rich.table import Table

    rates: dict[str, dict[int, list[float]]] = {line: {n: [] for n in args.tokens} for line in ("tiles", "int8")}
    for r in range(args.rounds):
        for line in ("tiles", "int8") if r % 2 == 0 else ("int8", "tiles"):
            cmd = [sys.executable, __file__, "--worker", line, "--tokens", ",".join(map(str, args.tokens)),
                   "--model", args.model, *(["--gguf", args.gguf] if args.gguf else [])]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{line} failed:\n{run.stderr[-3000:]}")
            for n, v in json.loads(run.stdout.strip().splitlines()[-1]).items():
                rates[line][int(n)].append(v)
        print(f"round {r + 1} done", flush=True)
    t = Table(title=f"prefill tokens/s of one step, {args.gguf or args.model} as stored, native, "
                    f"median of {args.rounds} rounds (best of 3 steps each)")
    for col in ("tokens", "AMX tiles", "int8 paths", "tiles / int8"):
        t.add_column(col, justify="right")
    for n in args.tokens:
        a, b = statistics.median(rates["tiles"][n]), statistics.median(rates["int8"][n])
        t.add_row(str(n), f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}")
    Console().print(t)


if __name__ == "__main__":
    main()
