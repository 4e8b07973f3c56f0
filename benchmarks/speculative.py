"""Speculative decoding side by side: the same backend with and without n-gram drafts, greedy,
batch 1 (one request at a time), on prompts whose answers quote their input (repeat a text, edit
a code file) and on open chat prompts; rounds interleaved so a noisy machine's drift hits both.

Decode tokens/s is each request's own: output tokens after the first over the time from the
first token to the last (1 / TPOT), median over prompts and rounds. Tokens are checked equal.

    python benchmarks/speculative.py                          # onnxruntime, the default model
    python benchmarks/speculative.py --backend torch --k 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from importlib.resources import files

from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.quality import shipped_text

CHAT = ["What is the capital of France, and why is it famous?", "Write a haiku about the sea.",
        "Explain what a hash table is to a child.", "Give three tips for learning to cook."]


def workloads(llm: LLM) -> dict[str, list[str]]:
    text = " ".join(shipped_text().split()[:380])                     # ~500 tokens
    code = files("twophase.core").joinpath("block_pool.py").read_text()  # ~600 tokens
    t = llm.apply_chat_template
    return {
        "quote a text": [t(f"Repeat this text word for word:\n\n{text}"),
                         t(f"Copy out the first two paragraphs of this text exactly:\n\n{text}")],
        "edit a code file": [t(f"Rename the class BlockPool to Pool in this file and show the "
                               f"whole file:\n\n{code}"),
                             t(f"Add a comment above every method of this file and show the "
                               f"whole file:\n\n{code}")],
        "open chat": [t(q) for q in CHAT],
    }


def build(args, speculative: bool) -> LLM:
    cfg = {"model": {}, "backend": {"name": args.backend}, "cache": {"num_blocks": 256}}
    if speculative:
        cfg["speculative"] = {"method": "ngram", "num_tokens": args.k}
    return LLM.from_config(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify pass (speculative.num_tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    engines = {"off": build(args, False), "ngram": build(args, True)}
    loads = workloads(engines["off"])
    p = SamplingParams(max_tokens=args.max_tokens)
    rates = {(w, e): [] for w in loads for e in engines}
    spec = {w: {"draft": 0, "kept": 0, "passes": 0} for w in loads}
    mismatches = 0
    for _ in range(args.rounds):
        for w, prompts in loads.items():
            for prompt in prompts:
                outs = {}
                for e, llm in engines.items():            # interleaved: each prompt on both
                    llm.reset_stats()
                    (out,) = llm.generate([prompt], p)
                    outs[e] = out
                    if out.metrics["tpot_s"]:
                        rates[(w, e)].append(1 / out.metrics["tpot_s"])
                    if e == "ngram" and (s := llm.report([out])["speculative"]):
                        spec[w]["draft"] += s["draft_tokens"]
                        spec[w]["kept"] += s["accepted_tokens"]
                        spec[w]["passes"] += s["verify_passes"]
                mismatches += outs["off"].token_ids != outs["ngram"].token_ids
    table = Table(title=f"decode tokens/s at batch 1, {args.backend}, greedy, k = {args.k} "
                        f"(median of {args.rounds} rounds x prompts)")
    for col in ("workload", "off", "ngram", "ratio", "acceptance", "mean accepted length"):
        table.add_column(col, justify="right")
    for w in loads:
        off, on = (statistics.median(rates[(w, e)]) for e in ("off", "ngram"))
        s = spec[w]
        table.add_row(w, f"{off:.1f}", f"{on:.1f}", f"x{on / off:.2f}",
                      f"{s['kept'] / s['draft']:.0%}" if s["draft"] else "-",
                      f"{1 + s['kept'] / s['passes']:.2f}" if s["passes"] else "-")
    console = Console()
    console.print(table)
    console.print(f"outputs that differ with speculation: {mismatches} (greedy: near-ties only)")


if __name__ == "__main__":
    main()
