"""A short bf16 llama3-8b benchmark (random weights) on the torch backend: prefill tokens/s and
decode step time at a few batch and prompt sizes, one table. Run by scripts/gpu_check.sh."""

from __future__ import annotations

import time

import torch

from twophase import LLM, SamplingParams

CASES = [(1, 512), (1, 2048), (8, 512), (32, 128), (64, 128)]     # (sequences, prompt tokens)
DECODE_STEPS = 32


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    llm = LLM.from_config({"model": {"name": "llama3-8b", "weights": "random", "dtype": "bfloat16",
                                     "max_model_len": 4096},
                           "backend": {"name": "torch", "device": "cuda"},
                           "cache": {"num_blocks": 4096, "prefix_caching": False}})
    timed(llm, [[11] * 64] * 2, 4)                           # warm-up
    print(f"{'seqs':>5} {'prompt':>7} {'prefill tok/s':>14} {'decode ms/step':>15} {'decode tok/s':>13}")
    for seqs, prompt in CASES:
        prompts = [[(7 * i + j) % 5000 + 10 for j in range(prompt)] for i in range(seqs)]
        prefill = timed(llm, prompts, 1)
        step = (timed(llm, prompts, DECODE_STEPS + 1) - prefill) / DECODE_STEPS
        print(f"{seqs:>5} {prompt:>7} {seqs * prompt / prefill:>14,.0f} {step * 1e3:>15.2f} "
              f"{seqs / step:>13,.0f}")


if __name__ == "__main__":
    main()
