"""Throughput of twophase vs HF transformers on the default model (CPU, fp32), in one process.

1. Load: ``llm.load_time_s``, and the wall time of the imports (torch's included) + ``from_config``.
2. Workload: 64 requests (16 with --quick), prompts of uniform 32..512 random token ids (seed 0, ids
   in [100, 40000)), outputs of uniform 64..128 tokens, greedy, EOS ignored. twophase: one
   ``llm.generate`` (continuous batching). HF: ``model.generate`` on the same weights, read from
   twophase's converted HF folder (config.json + model.safetensors; saves dequantising the GGUF), in
   static batches of length-sorted prompts, left padded with an attention mask, ``min_new_tokens =
   max_new_tokens`` = the batch's longest requested output. Only each request's own requested
   tokens count as useful output (HF cannot stop a row early; its extra tokens are its cost). HF
   batch sizes 1, 8, 16, 32 (--quick: 8, 16), each measured in full, none extrapolated.
3. twophase decode tokens/s at batch 1, 8, 32 (128-token prompts, 64 output tokens; ``llm.report``
   charges mixed steps to decode too, "decode-only steps" does not) and prefill tokens/s of one
   512-token prompt. Both engines get a tiny warm-up call first; --threads sets torch's threads.

The ratio "twophase / HF best" is twophase's useful output tokens/s over that of HF's best batch
size (the total tokens/s ratio is the same number): above 1, twophase serves this workload faster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

MODEL = "smollm2-135m-instruct"
console = Console(width=None if sys.stdout.isatty() else 120)


def rand_prompts(n: int, lo: int, hi: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def rates(wall: float, n: int, prompt_tok: int, out_tok: int) -> dict[str, float]:
    return {"wall_s": wall, "requests_per_s": n / wall, "output_tokens_per_s": out_tok / wall,
            "total_tokens_per_s": (prompt_tok + out_tok) / wall}


def run_hf(model: Any, prompts: list[list[int]], outs: list[int], bs: int) -> float:
    """Seconds for HF to serve every request in static batches of ``bs``, sorted by length."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    t0 = time.perf_counter()
    for k in tqdm(range(0, len(order), bs), desc=f"HF batch {bs}", unit="batch"):
        idx = order[k:k + bs]
        width, new = max(len(prompts[i]) for i in idx), max(outs[i] for i in idx)
        pad = [width - len(prompts[i]) for i in idx]
        ids = torch.tensor([[0] * p + prompts[i] for p, i in zip(pad, idx)])
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pad])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=new, min_new_tokens=new)
    return time.perf_counter() - t0


def print_table(res: dict[str, Any]) -> None:
    t = Table(title=f"twophase vs HF transformers: {MODEL}, CPU fp32, torch threads: {res['torch_threads']}")
    for c in ("measurement", "req/s", "output tok/s", "total tok/s", "note"):
        t.add_column(c, justify="left" if c in ("measurement", "note") else "right")
    ld, tp, hf = res["load"], res["twophase"], res["hf"]
    t.add_row("load (from cache)", "", "", "", f"{ld['load_time_s']:.2f} s; "
              f"{ld['wall_with_imports_s']:.2f} s with imports")
    for name, r, note in [(f"twophase, {res['num_requests']} requests", tp, "continuous batching")] + [
            (f"HF static batch {b}", r, "best" if b == hf["best_batch"] else "") for b, r in hf["batch"].items()]:
        t.add_row(name, f"{r['requests_per_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
                  f"{r['total_tokens_per_s']:.1f}", note)
    t.add_row("[bold]twophase / HF best", "", f"[bold]{res['ratio_twophase_over_hf_best']:.2f}x", "",
              f"HF best = batch {hf['best_batch']}")
    for b, d in res["decode"].items():
        pure = d["pure_decode_tokens_per_s"]
        t.add_row(f"twophase decode, batch {b}", "", f"{d['decode_tokens_per_s']:.1f}", "",
                  f"{d['ratio_to_batch1']:.2f}x batch 1; decode-only steps: "
                  + (f"{pure:.1f} tok/s" if pure else "none"))
    t.add_row("twophase prefill, 512 tokens", "", "", f"{res['prefill_512_tokens_per_s']:.1f}",
              "prompt tokens/s, max_tokens=1")
    console.print(t)
    console.print(f"HF read {hf['source']} (twophase's converted folder of the GGUF's weights). HF "
                  "output counts each request's requested tokens only. Every HF batch size measured in "
                  "full." + (" --quick: 16 requests, HF batch sizes 8 and 16." if res["quick"] else "")
                  + f" Load average {res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at "
                  f"end, {os.cpu_count()} CPUs: on a busy machine pass --threads below the idle cores.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, HF batch sizes 8 and 16")
    ap.add_argument("--json", metavar="OUT", help="write every figure to this JSON file")
    ap.add_argument("--threads", type=int, help="torch threads for both engines (default: torch's)")
    args = ap.parse_args()
    n, hf_sizes = (16, [8, 16]) if args.quick else (64, [1, 8, 16, 32])
    res: dict[str, Any] = {"model": MODEL, "device": "cpu", "dtype": "float32", "quick": args.quick,
                           "num_requests": n, "loadavg_start": os.getloadavg()}

    console.rule("1. load")
    t0 = time.perf_counter()
    import torch

    from twophase.core.sampling_params import SamplingParams
    from twophase.llm import LLM
    from twophase.paths import cache_dir
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM.from_config({"model": {"name": MODEL}})
    res["load"] = {"load_time_s": llm.load_time_s, "wall_with_imports_s": time.perf_counter() - t0}
    res["torch_threads"] = torch.get_num_threads()
    console.print(res["load"])
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

    console.rule(f"2. workload: {n} requests through twophase")
    rng = random.Random(0)
    prompts = rand_prompts(n, 32, 512, rng)
    outs = [rng.randint(64, 128) for _ in range(n)]
    ptok, otok = sum(map(len, prompts)), sum(outs)
    res["workload"] = {"prompt_tokens": ptok, "output_tokens": otok}
    t0 = time.perf_counter()
    got = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in outs], use_tqdm=True)
    res["twophase"] = rates(time.perf_counter() - t0, n, ptok, otok)
    bad = [i for i, (o, m) in enumerate(zip(got, outs)) if len(o.token_ids) != m]
    res["twophase"]["wrong_output_lengths"] = len(bad)
    if bad:
        console.print(f"[red]twophase: {len(bad)} requests with the wrong output length: {bad}")

    folder = cache_dir() / "models" / MODEL
    console.rule(f"2. workload through HF transformers, from {folder}")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():  # warm-up
        model.generate(input_ids=torch.tensor([list(range(100, 132))]), max_new_tokens=4,
                       min_new_tokens=4, do_sample=False, pad_token_id=0)
    hf = res["hf"] = {"source": str(folder), "batch": {}}
    for bs in hf_sizes:
        hf["batch"][bs] = rates(run_hf(model, prompts, outs, bs), n, ptok, otok)
    hf["best_batch"] = max(hf["batch"], key=lambda b: hf["batch"][b]["output_tokens_per_s"])
    res["ratio_twophase_over_hf_best"] = (res["twophase"]["output_tokens_per_s"]
                                          / hf["batch"][hf["best_batch"]]["output_tokens_per_s"])
    del model

    console.rule("3. twophase decode (128-token prompts, 64 output tokens) and prefill")
    res["decode"] = {}
    for b in tqdm((1, 8, 32), desc="decode batches"):
        llm.reset_stats()
        rep = llm.report(llm.generate(rand_prompts(b, 128, 128, rng), SamplingParams(max_tokens=64, ignore_eos=True)))
        pure = rep["steps_by_mix"].get("decode", {})
        res["decode"][b] = {"decode_tokens_per_s": rep["decode_tokens_per_s"],
                            "pure_decode_tokens_per_s": pure["decode_tokens"] / pure["seconds"]
                            if pure.get("seconds") else None,
                            "ratio_to_batch1": rep["decode_tokens_per_s"] / res["decode"][1]["decode_tokens_per_s"]
                            if b > 1 else 1.0}
    llm.reset_stats()
    rep = llm.report(llm.generate(rand_prompts(1, 512, 512, rng), SamplingParams(max_tokens=1, ignore_eos=True)))
    res["prefill_512_tokens_per_s"] = rep["prefill_tokens_per_s"]
    res["loadavg_end"] = os.getloadavg()

    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
