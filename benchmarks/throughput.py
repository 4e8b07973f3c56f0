"""Throughput of twophase against HF transformers on the default model (CPU, fp32), in one process.

Measured, in order:
1. Load: ``llm.load_time_s`` and the wall time of ``import twophase`` + ``LLM.from_config`` (torch
   import included, since nothing imports torch earlier in this process).
2. Workload: N requests (64; 16 with --quick), prompts of uniform 32..512 random token ids
   (seed 0, ids in [100, 40000)), outputs of uniform 64..128 tokens, greedy, EOS ignored.
   twophase: one ``llm.generate`` call (continuous batching). HF: ``model.generate`` on the same
   weights (the converted HF folder twophase loads: config.json + model.safetensors, which saves the
   GGUF dequantisation), static batches of prompts sorted by length, left padding + attention
   mask, ``min_new_tokens = max_new_tokens =`` the batch's longest requested output. HF cannot stop
   a row early, so only each request's own requested tokens count as useful output; the extra
   tokens it computes are its cost. Batch sizes 1, 8, 16, 32 (--quick: 8, 16); every one is
   measured in full, none extrapolated. Both sides get one tiny warm-up call first.
3. twophase decode tokens/s at batch 1, 8, 32 (128-token prompts, 64 output tokens) from
   ``llm.report``, which charges mixed prefill+decode steps to decode too; "pure" counts
   decode-only steps. Prefill tokens/s: one 512-token prompt, max_tokens=1.

Reading the ratio: "twophase / HF best" divides twophase's useful output tokens/s by the best HF
batch size's. Above 1, twophase serves this workload faster than HF at its best static batch size;
both sides produce exactly the same useful tokens, so total tokens/s ratio is the same number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
console = Console()


def make_workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    return prompts, [rng.randint(64, 128) for _ in range(n)]


def rand_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_hf(model: Any, prompts: list[list[int]], outs: list[int], bs: int) -> float:
    """Seconds for HF to serve every request in static batches of ``bs``, sorted by length."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    t0 = time.perf_counter()
    for k in tqdm(range(0, len(order), bs), desc=f"HF batch {bs}", unit="batch"):
        idx = order[k:k + bs]
        width, new = max(len(prompts[i]) for i in idx), max(outs[i] for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=new, min_new_tokens=new)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, HF batch sizes 8 and 16")
    ap.add_argument("--json", metavar="OUT", help="write every figure to this JSON file")
    args = ap.parse_args()
    n, hf_sizes = (16, [8, 16]) if args.quick else (64, [1, 8, 16, 32])
    res: dict[str, Any] = {"model": MODEL, "device": "cpu", "dtype": "float32",
                           "quick": args.quick, "num_requests": n}

    console.rule("1. load")
    t0 = time.perf_counter()
    from twophase.core.params import SamplingParams
    from twophase.llm import LLM
    llm = LLM.from_config({"model": {"name": MODEL}})
    res["load"] = {"load_time_s": llm.load_time_s, "wall_with_imports_s": time.perf_counter() - t0}
    import torch
    res["torch_threads"] = torch.get_num_threads()
    console.print(res["load"])
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

    console.rule(f"2. workload: {n} requests, twophase")
    prompts, outs = make_workload(n)
    prompt_tok, useful = sum(map(len, prompts)), sum(outs)
    res["workload"] = {"prompt_tokens": prompt_tok, "output_tokens": useful}
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in outs]
    t0 = time.perf_counter()
    got = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    bad = [i for i, (o, m) in enumerate(zip(got, outs)) if len(o.token_ids) != m]
    if bad:
        console.print(f"[red]twophase: {len(bad)} requests with the wrong output length: {bad}")
    res["twophase"] = {"wall_s": wall, "requests_per_s": n / wall, "output_tokens_per_s": useful / wall,
                       "total_tokens_per_s": (prompt_tok + useful) / wall, "wrong_lengths": len(bad)}

    from twophase.models import hub
    folder = hub.cache_dir() / "models" / MODEL
    console.rule(f"2. workload: HF transformers from {folder}")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():  # warm-up
        model.generate(input_ids=torch.tensor([list(range(100, 132))]), max_new_tokens=4,
                       min_new_tokens=4, do_sample=False, pad_token_id=0)
    res["hf"] = {"source": str(folder), "batch": {}}
    for bs in hf_sizes:
        s = run_hf(model, prompts, outs, bs)
        res["hf"]["batch"][bs] = {"wall_s": s, "requests_per_s": n / s, "output_tokens_per_s": useful / s,
                                  "total_tokens_per_s": (prompt_tok + useful) / s}
    best = max(res["hf"]["batch"], key=lambda b: res["hf"]["batch"][b]["output_tokens_per_s"])
    res["hf"]["best_batch"] = best
    res["ratio_twophase_over_hf_best"] = (res["twophase"]["output_tokens_per_s"]
                                          / res["hf"]["batch"][best]["output_tokens_per_s"])
    del model

    console.rule("3. twophase decode and prefill")
    res["decode"] = {}
    for b in (1, 8, 32):
        llm.reset_stats()
        o = llm.generate(rand_prompts(b, 128, seed=100 + b), SamplingParams(max_tokens=64, ignore_eos=True))
        rep = llm.report(o)
        pure = rep["steps_by_mix"].get("decode", {})
        res["decode"][b] = {"decode_tokens_per_s": rep["decode_tokens_per_s"],
                            "pure_decode_tokens_per_s": pure["decode_tokens"] / pure["seconds"]
                            if pure.get("seconds") else None}
        console.print(f"batch {b}: {res['decode'][b]}")
    for b in (1, 8, 32):
        d = res["decode"][b]
        d["ratio_to_batch1"] = d["decode_tokens_per_s"] / res["decode"][1]["decode_tokens_per_s"]
    llm.reset_stats()
    o = llm.generate(rand_prompts(1, 512, seed=7), SamplingParams(max_tokens=1, ignore_eos=True))
    res["prefill_512_tokens_per_s"] = llm.report(o)["prefill_tokens_per_s"]

    table = Table(title=f"twophase vs HF transformers — {MODEL}, CPU fp32, {res['torch_threads']} threads")
    table.add_column("measurement")
    for c in ("req/s", "output tok/s", "total tok/s", "note"):
        table.add_column(c, justify="right" if c != "note" else "left")
    tp = res["twophase"]
    table.add_row("load (from cache)", "", "", "",
                  f"{res['load']['load_time_s']:.2f} s; {res['load']['wall_with_imports_s']:.2f} s with imports")
    table.add_row(f"twophase, {n} requests", f"{tp['requests_per_s']:.3f}", f"{tp['output_tokens_per_s']:.1f}",
                  f"{tp['total_tokens_per_s']:.1f}", "continuous batching")
    for bs, r in res["hf"]["batch"].items():
        table.add_row(f"HF static batch {bs}", f"{r['requests_per_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
                      f"{r['total_tokens_per_s']:.1f}", "best" if bs == best else "")
    table.add_row("[bold]ratio twophase / HF best", "", f"[bold]{res['ratio_twophase_over_hf_best']:.2f}x",
                  "", f"HF best = batch {best}")
    for b, d in res["decode"].items():
        pure = d["pure_decode_tokens_per_s"]
        table.add_row(f"twophase decode, batch {b}", "", f"{d['decode_tokens_per_s']:.1f}", "",
                      f"{d['ratio_to_batch1']:.2f}x batch 1; decode-only steps "
                      + (f"{pure:.1f}" if pure else "n/a"))
    table.add_row("twophase prefill, 512-token prompt", "", "", f"{res['prefill_512_tokens_per_s']:.1f}",
                  "prompt tok/s")
    console.print(table)
    console.print(f"HF loads {folder} (twophase's converted HF folder, same weights as the GGUF). "
                  "HF output counts only each request's requested tokens (its padded extra decode "
                  "steps are wasted work). All HF batch sizes measured in full, none extrapolated."
                  + (" --quick: 16 requests, HF batch sizes 8 and 16 only." if args.quick else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
