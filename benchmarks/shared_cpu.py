"""Decode beside a busy neighbour: tokens/s of one request (and of a batch) on a quiet machine and
with a process spinning on one core beside it, each line in a process of its own, rounds
interleaved.

    python benchmarks/shared_cpu.py [--lines native-q4,torch] [--threads 2] [--batch 1,32]
                                    [--tokens 64] [--rounds 3] [--env native-q4:OMP_WAIT_POLICY=passive]

A decode step of the native backend is hundreds of OpenMP barriers; a thread of it that shares
its core with another process waits for its turn there at each one, and its partner waits at
the barrier. ``native-q4`` runs on fewer threads while other processes hold cores
(``twophase.measure.thread_governor``); ``native-q4-fixed`` keeps its threads whatever happens
(``share_cpu = false``), ``native-q4-1`` runs one. ``--env LINE:NAME=VALUE`` runs a line again
with an environment variable set (an OpenMP runtime's wait policy, say), to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LINES = {"native-q4": ({"name": "native"}, "q4"),              # fewer threads while a core is held
         "native-q4-fixed": ({"name": "native", "options": {"share_cpu": False}}, "q4"),   # as before
         "native-q4-1": ({"name": "native", "options": {"threads": 1}}, "q4"),
         "torch": ({"name": "torch"}, "none")}


def worker(line: str, threads: int, batch: int, tokens: int) -> dict:
    from twophase import LLM, SamplingParams

    backend, quant = LINES[line]
    backend = {**backend, "options": {"threads": threads, **backend.get("options", {})}}   # the line's own win
    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct", "quantization": quant},
                           "backend": backend})
    llm.generate([[1000 + i for i in range(16)]], SamplingParams(max_tokens=8, ignore_eos=True))   # warm
    prompts = [[1000 + (7 * r + i) % 5000 for i in range(32)] for r in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    decode_s = max(o.metrics["e2e_s"] - o.metrics["ttft_s"] for o in outs)
    return {"tok_s": batch * (tokens - 1) / decode_s, "wall_s": wall}


def spinner() -> subprocess.Popen:
    """A process that holds one core: a busy loop, as a neighbour's job would."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", default="native-q4,torch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--env", action="append", default=[], help="LINE:NAME=VALUE, a line run again with it set")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--b", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.b, args.tokens)))
        return
    runs = [(ln, "") for ln in args.lines.split(",")] + [tuple(e.split(":", 1)) for e in args.env]
    batches = [int(b) for b in args.batch.split(",")]
    got: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for busy in (False, True):
            for line, env in runs[r % len(runs):] + runs[:r % len(runs)]:     # each line first in turn
                for b in batches:
                    extra = dict([env.split("=", 1)]) if env else {}
                    noise = spinner() if busy else None
                    try:
                        run = subprocess.run([sys.executable, __file__, "--worker", line, "--threads",
                                              str(args.threads), "--b", str(b), "--tokens", str(args.tokens)],
                                             capture_output=True, text=True, env={**os.environ, **extra})
                    finally:
                        if noise is not None:
                            noise.kill()
                            noise.wait()
                    if run.returncode:
                        raise SystemExit(f"{line} failed:\n{run.stderr[-3000:]}")
                    res = json.loads(run.stdout.strip().splitlines()[-1])
                    got.setdefault((line, env, b, busy), []).append(res["tok_s"])
                    print(f"round {r + 1} {line} {env} batch {b} {'busy' if busy else 'quiet'}: "
                          f"{res['tok_s']:.1f} tok/s", flush=True)
    print("\n| line | batch | quiet tok/s | one core busy tok/s | busy / quiet |\n|---|---|---|---|---|")
    for line, env in runs:
        for b in batches:
            q = statistics.median(got[(line, env, b, False)])
            y = statistics.median(got[(line, env, b, True)])
            print(f"| {line} {env} | {b} | {q:.1f} | {y:.1f} | {y / q:.2f} |")


if __name__ == "__main__":
    main()
