"""The memory plan against the truth under `twophase bench`'s serving workload, on the CPU.

Each config runs in a process of its own (a clean resident set): the plan is made, the model
loaded, and the bench's default serving workload (32 requests at once, prompts of 32-256 random
tokens, 16-64 output tokens) served while a thread samples the resident set every 2 ms. Items:

- runtime + weights: the resident set after load (the interpreter, libraries, the first torch
  model's threads, the weights);
- KV cache: the pool is calloc'd, so only blocks written are resident: those counted after the
  run (blocks with any non-zero element), against the blocks the workload needs; and the pool's
  mapping's resident bytes (``/proc/self/smaps``) against the whole pool: with transparent huge
  pages a written block faults in 2 MiB around it;
- step peak: the rest of the peak during serving (activations, logits, allocator slack),
  against the planner's formula at the workload's shape (its batch, its longest context);
- the whole process's peak against the plan's total (the whole pool, the step at the engine's
  limits: the plan is meant to be an upper bound).

    python benchmarks/memory.py [--json memory.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time

from twophase.device import resident_bytes as rss

CONFIGS = {
    "torch fp32": {"backend": {"name": "torch"}},
    "native q4": {"model": {"quantization": "q4"}, "backend": {"name": "native"}},
    "onnxruntime prefill + native decode, q4": {
        "model": {"quantization": "q4"},
        "backend": {"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}},
}
MiB = 1 << 20


def resident(start: int, size: int) -> int:
    """Resident bytes of the mappings overlapping ``[start, start + size)`` (``/proc/self/smaps``;
    the kernel splits one allocation into several where huge pages begin and end)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo < start + size and hi > start
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def measure(cfg: dict, out: mp.Queue) -> None:
    import torch

    from twophase import LLM
    from twophase.bench import serving
    from twophase.config import load_config
    from twophase.plan import plan, profile
    from twophase.plan.budget import activation_peak, token_budget

    config = load_config(cfg)
    p = plan(config, profile("cpu"))
    llm = LLM(config)
    r1 = rss()
    s = config.bench.serving
    reqs = serving.synthetic(s.num_requests, None, s.input_len, s.output_len, llm.model.arch.vocab_size)
    peak, done = [r1], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    serving.run(llm.engine, reqs)
    done.set()
    t.join()
    pool = llm.kv_cache.pool
    touched = int((pool.transpose(0, 2).reshape(pool.shape[2], -1) != 0).any(1).sum())
    per_block = pool[:, :, 0].numel() * pool.element_size()
    pool_rss = resident(pool.data_ptr(), pool.numel() * pool.element_size())
    users, longest = min(s.num_requests, config.scheduler.max_num_seqs), s.input_len[1] + s.output_len[1]
    act, how = activation_peak(llm.model.arch, token_budget(config, "cpu", llm.max_model_len), users,
                               longest, 4)
    needed = sum(-(-(len(r.prompt) + r.max_tokens) // config.cache.block_size) for r in reqs)
    logits = users * llm.model.arch.vocab_size * 4
    out.put({"runtime + weights, after load": (p.total("runtime") + p.total("weights", resident=True), r1),
             "KV blocks written": (min(needed, llm.num_blocks) * per_block, touched * per_block),
             "KV pool resident": (pool.numel() * pool.element_size(), pool_rss),
             "step peak (workload's shape)": (act + logits, peak[0] - r1 - pool_rss),
             "whole process, peak": (p.total() - p.total("reserve"), peak[0]),
             "threads": torch.get_num_threads(), "step formula": how})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for name, cfg in CONFIGS.items():
        q = ctx.Queue()
        proc = ctx.Process(target=measure, args=(cfg, q))
        proc.start()
        results[name] = q.get()
        proc.join()
        print(f"\n{name}\n{'item':<32}{'predicted MiB':>15}{'measured MiB':>15}{'gap':>8}")
        for item, pair in results[name].items():
            if isinstance(pair, tuple):
                want, got = pair
                print(f"{item:<32}{want / MiB:>15,.1f}{got / MiB:>15,.1f}{100 * (got - want) / max(want, 1):>7.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
