"""Speculative decoding side by side: the same backend without drafts, with drafts at a fixed
k, and with ``num_tokens = "auto"``; greedy, on prompts whose answers quote their input (repeat
a text, edit a code file) and on open chat prompts; rounds interleaved so a noisy machine's drift
hits all three alike. Tokens are checked equal.

Drafts come from n-gram lookup (``--method ngram``) or a draft model (``--method draft``: the
model's own 4-bit blocks, prefilled on onnxruntime and drafting on the native backend).

At batch 1 (one request at a time) decode tokens/s is each request's own 1 / TPOT, the median
over prompts; at ``--batch N`` N requests run at once and the rate is over the decode-only steps.

    python benchmarks/speculative.py                          # onnxruntime, the default model
    python benchmarks/speculative.py --method draft --workloads "open chat"
    python benchmarks/speculative.py --batch 32 --max-tokens 64
    python benchmarks/speculative.py --backend torch --k 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from importlib.resources import files

from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.measure.quality import shipped_text

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


Q4_DRAFT = {"quantization": "q4",
            "backend": {"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}}


def build(args, num_tokens: int | str | None) -> LLM:
    cfg = {"model": {}, "backend": {"name": args.backend}, "cache": {"num_blocks": 1024}}
    if num_tokens is not None:
        cfg["speculative"] = {"method": args.method, "num_tokens": num_tokens}
        if args.method == "draft":
            cfg["speculative"]["draft"] = Q4_DRAFT
    return LLM.from_config(cfg)


def rate(llm: LLM, prompts: list[str], p: SamplingParams, batch: int) -> tuple[float, list, dict]:
    """Decode tokens/s: at batch 1, the median over prompts of each request's 1 / TPOT; at
    batch N, N requests at once (the prompts repeated) over the decode-only steps."""
    llm.reset_stats()
    if batch == 1:
        outs = [llm.generate([q], p)[0] for q in prompts]
        value = statistics.median(1 / o.metrics["tpot_s"] for o in outs if o.metrics["tpot_s"])
    else:
        outs = llm.generate([prompts[i % len(prompts)] for i in range(batch)], p)
        value = llm.report(outs)["decode_tokens_per_s"]
    return value, [o.token_ids for o in outs], llm.report(outs)["speculative"] or {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify pass (speculative.num_tokens)")
    ap.add_argument("--workloads", nargs="+", help="only these (default: all three)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (default 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    engines = {"off": build(args, None), f"k = {args.k}": build(args, args.k),
               "auto": build(args, "auto")}
    loads = workloads(engines["off"])
    if args.workloads:
        unknown = set(args.workloads) - set(loads)
        if unknown:
            ap.error(f"unknown workload {sorted(unknown)[0]!r}; known: {', '.join(map(repr, loads))}")
        loads = {w: loads[w] for w in args.workloads}
    p = SamplingParams(max_tokens=args.max_tokens)
    rates = {(w, e): [] for w in loads for e in engines}
    kept = {(w, e): [0, 0] for w in loads for e in engines}
    mismatches = 0
    for _ in range(args.rounds):
        for w, prompts in loads.items():
            tokens = {}
            for e, llm in engines.items():                 # interleaved: each workload on all
                value, tokens[e], spec = rate(llm, prompts, p, args.batch)
                rates[(w, e)].append(value)
                kept[(w, e)][0] += spec.get("accepted_tokens", 0)
                kept[(w, e)][1] += spec.get("verify_passes", 0)
            mismatches += sum(t != tokens["off"] for t in tokens.values())
    drafts = "n-gram" if args.method == "ngram" else "q4 draft model (onnxruntime -> native)"
    table = Table(title=f"decode tokens/s at batch {args.batch}, {args.backend}, greedy, {drafts} "
                        f"(median of {args.rounds} rounds)")
    table.add_column("workload")
    for e in engines:
        table.add_column(e, justify="right")
    for w in loads:
        base = statistics.median(rates[(w, "off")])
        cells = []
        for e in engines:
            v = statistics.median(rates[(w, e)])
            k, passes = kept[(w, e)]
            tail = f" x{v / base:.2f}" + (f", {1 + k / passes:.2f}/pass" if passes else "")
            cells.append(f"{v:.1f}" + ("" if e == "off" else tail))
        table.add_row(w, *cells)
    console = Console()
    console.print(table)
    console.print("x: against off, side by side; n/pass: mean accepted length (tokens a verify "
                  f"pass gives a sequence). Outputs that differ from off: {mismatches} "
                  "(greedy: near-ties only)")


if __name__ == "__main__":
    main()
