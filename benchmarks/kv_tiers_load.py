"""What the host and disk tiers cost a busy engine: output tokens/s of a serving load with the
tiers off and on, each run in a process of its own, rounds interleaved.

    python benchmarks/kv_tiers_load.py [--model smollm2-135m-instruct] [--backend torch]
                                       [--requests 32] [--rate 4] [--rounds 3]

Two loads, both with prefix caching on and a pool too small for everything they send, so the pool
evicts all along (with tiers on, each evicted block is copied to host memory, and host memory's
overflow is written to disk by the writer thread):

- ``unique``: every prompt different. The tiers can only cost here: copies and writes of blocks
  no request asks for again. This is the overhead figure.
- ``shared``: prompts open with one of a few long system prompts, more of them than the pool
  holds, so a prefix comes back after it was evicted. The tiers save those prefills here.

Requests arrive as a Poisson process at ``--rate`` a second (the server's situation: work joins
a running batch), 256 to 384 prompt tokens (the shared load: a 320-token system prompt and 32 of
the request's own), 32 output tokens each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile

LINES = ("off", "on")


def _requests(load: str, n: int, rate: float, vocab: int, seed: int = 0):
    from twophase.bench.serving import TimedRequest

    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(320)] for _ in range(8)]
    t, out = 0.0, []
    for _ in range(n):
        own = [rng.randrange(3, vocab) for _ in range(32 if load == "shared" else rng.randint(256, 384))]
        prompt = systems[rng.randrange(len(systems))] + own if load == "shared" else own
        out.append(TimedRequest(t, prompt, 32))
        t += rng.expovariate(rate)
    return out


def worker(args) -> dict:
    from twophase import LLM
    from twophase.bench.serving import run

    cfg: dict = {"model": {"name": args.model}, "backend": {"name": args.backend},
                 "cache": {"num_blocks": args.blocks, "prefix_caching": True}}
    if args.worker == "on":
        cfg["cache"]["offload"] = {"host_gib": args.host_gib, "disk_dir": args.disk, "disk_gib": 4.0}
    llm = LLM.from_config(cfg)
    llm.generate([list(range(1000, 1064))])                  # warm
    reqs = _requests(args.load, args.requests, args.rate, llm.engine.vocab_size or 49152)
    res = run(llm.engine, reqs)
    tiers = llm.engine.tier_stats() or {}
    llm.close()
    return {"tok_s": res["output_tokens_per_s"], "wall_s": res["wall_s"],
            "ttft_p50": res["ttft_s"]["p50"], "hit_tokens": llm.engine.stats().prefix_hits,
            "tiers": {k: round(v, 3) for k, v in tiers.items()
                      if k.endswith(("hits", "restored_blocks", "dropped", "bytes_written", "seconds"))}}


def _run(args, line: str, load: str, disk: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", line, "--load", load, "--disk", disk, "--model", args.model,
           "--backend", args.backend, "--requests", str(args.requests), "--rate", str(args.rate),
           "--blocks", str(args.blocks), "--host-gib", str(args.host_gib)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{line}/{load} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals a second (Poisson)")
    ap.add_argument("--blocks", type=int, default=96, help="the pool's blocks (16 tokens each)")
    ap.add_argument("--host-gib", type=float, default=0.05, help="the host tier (small: disk takes the rest)")
    ap.add_argument("--loads", default="unique,shared")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", choices=LINES, help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    loads = args.loads.split(",")
    got: dict[tuple[str, str], list[dict]] = {(ld, ln): [] for ld in loads for ln in LINES}
    for r in range(args.rounds):
        for load in loads:
            for line in (LINES if r % 2 == 0 else LINES[::-1]):
                res = _run(args, line, load, tempfile.mkdtemp(prefix="twophase-tiers-load-"))
                got[(load, line)].append(res)
                print(f"round {r + 1} {load:6s} tiers {line:3s}: {res['tok_s']:.1f} tok/s, "
                      f"TTFT p50 {res['ttft_p50']:.3f} s, hit tokens {res['hit_tokens']}, {res['tiers']}",
                      flush=True)
    print("\n| load | tiers off tok/s | tiers on tok/s | on / off (median of rounds' ratios) "
          "| steps handing blocks down | writer thread CPU |\n|---|---|---|---|---|---|")
    for load in loads:
        off, on = got[(load, "off")], got[(load, "on")]
        ratio = statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(off, on))
        share = statistics.median(b["tiers"]["offload_seconds"] / b["wall_s"] for b in on)
        writer = statistics.median(b["tiers"]["disk_writer_cpu_seconds"] / b["wall_s"] for b in on)
        print(f"| {load} | {statistics.median(a['tok_s'] for a in off):.1f} | "
              f"{statistics.median(b['tok_s'] for b in on):.1f} | {ratio:.3f} | {100 * share:.2f}% of the wall "
              f"| {100 * writer:.2f}% of a core |")


if __name__ == "__main__":
    main()
