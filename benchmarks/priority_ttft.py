"""Request priorities against a flood: a few urgent requests' time to first token behind a burst
of long low-priority prompts, with priorities (flood 10, urgent 0) against all equal (FCFS).

The flood is queued first; the urgent requests arrive ``--after`` engine steps later. Both modes
serve the same token ids (prefix caching off, so no round reuses another's blocks), on the
default model through the Engine API, rounds interleaved; the figures are medians over rounds.

    python benchmarks/priority_ttft.py                  # 32 x 256-token flood, 4 urgent, 3 rounds
    python benchmarks/priority_ttft.py --rounds 5 --json priority.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from twophase import LLM, SamplingParams
from twophase.core.request import Request


def run(llm: LLM, flood: list[list[int]], urgent: list[list[int]], args: argparse.Namespace,
        low: int) -> dict[str, float]:
    """One round to the end; ``low``: the flood's priority (the urgent requests' is 0)."""
    eng = llm.engine
    before = eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    slow = [eng.add_request(p, SamplingParams(max_tokens=args.flood_tokens, ignore_eos=True),
                            priority=low) for p in flood]
    for _ in range(args.after):
        eng.step()
    fast: list[Request] = [eng.add_request(p, SamplingParams(max_tokens=args.urgent_tokens,
                                                             ignore_eos=True)) for p in urgent]
    while eng.has_unfinished():
        eng.step()
    ttft = [r.times.ttft or 0.0 for r in fast]
    return {"urgent_ttft_s": statistics.median(ttft), "urgent_ttft_max_s": max(ttft),
            "flood_ttft_s": statistics.median(r.times.ttft or 0.0 for r in slow),
            "all_done_s": time.perf_counter() - t0,
            "preemptions": eng.scheduler.num_preemptions - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=32, help="low-priority requests, queued first")
    ap.add_argument("--flood-len", type=int, default=256, help="their prompt tokens")
    ap.add_argument("--flood-tokens", type=int, default=32, help="their output tokens")
    ap.add_argument("--urgent", type=int, default=4, help="high-priority requests, queued after")
    ap.add_argument("--urgent-len", type=int, default=64)
    ap.add_argument("--urgent-tokens", type=int, default=8)
    ap.add_argument("--after", type=int, default=2, help="engine steps between flood and urgent")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct"},
                           "cache": {"num_blocks": 2048, "prefix_caching": False}})
    vocab = llm.model.arch.vocab_size
    rng = random.Random(0)
    flood = [[rng.randrange(100, vocab) for _ in range(args.flood_len)] for _ in range(args.flood)]
    urgent = [[rng.randrange(100, vocab) for _ in range(args.urgent_len)] for _ in range(args.urgent)]
    llm.generate(flood[:2] + urgent[:2], SamplingParams(max_tokens=4))           # warm
    modes = {"priorities (flood 10, urgent 0)": 10, "all equal (FCFS)": 0}
    got: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, low in modes.items():
            got[mode].append(run(llm, flood, urgent, args, low))
    print(f"{args.flood} flood requests of {args.flood_len} tokens ({args.flood_tokens} out), "
          f"{args.urgent} urgent of {args.urgent_len} ({args.urgent_tokens} out) after {args.after} "
          f"steps; budget {llm.engine.scheduler.budget} tokens a step; medians of {args.rounds} rounds")
    figures = {}
    for mode, rounds in got.items():
        figures[mode] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        f = figures[mode]
        print(f"{mode:34s} urgent TTFT {f['urgent_ttft_s']:.2f} s (max {f['urgent_ttft_max_s']:.2f}), "
              f"flood TTFT {f['flood_ttft_s']:.2f} s, all done {f['all_done_s']:.2f} s, "
              f"{f['preemptions']:.0f} preemptions")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
