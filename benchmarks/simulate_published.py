"""Simulated against published: serving figures other engines published for Llama-3-8B-class
models on one H100 or A100, reproduced by ``twophase simulate`` with its default device figures
(datasheet peaks, 0.55 of compute, 0.8 of bandwidth, 1 ms a step: nothing fitted to these
results) and one engine config for every case (bfloat16, ``max_num_seqs`` 256 as vLLM's default,
the CUDA token budget of 4096, chunked prefill).

    python benchmarks/simulate_published.py [--only NAME] [--json FILE]

The sources (every figure copied from them; lengths fixed, all at once unless a rate is given):

- TensorRT-LLM 0.14.0 "Throughput Measurements" (docs/source/performance/perf-overview.md,
  v0.14.0 revision): Llama 3.1 8B, TP1, FP16, output tokens/s, synthetic prompts of exactly
  ISL/OSL tokens sent at an infinite rate (``trtllm-bench throughput``).
- TensorRT-LLM 0.14.0 "Online Serving Measurements" (same document): Llama 3.1 8B, H100 80GB,
  TP1, BF16, 500 requests at a fixed QPS: output tokens/s, mean TTFT, mean ITL. Poisson
  arrivals are assumed here (the document does not say).
- vLLM pull request #7117 (2024-08-04, https://github.com/vllm-project/vllm/pull/7117):
  Meta-Llama-3-8B on an H100, ``benchmark_throughput.py --input-len 256 --output-len 256``
  (1000 prompts, all at once): 24.32 / 24.11 / 24.29 requests/s over three runs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from twophase.bench.serving import synthetic
from twophase.config import load_config
from twophase.simulate import simulate
from twophase.simulate.devices import device_spec

TRT_OFFLINE = "TensorRT-LLM 0.14.0 perf-overview, throughput (FP16)"
TRT_ONLINE = "TensorRT-LLM 0.14.0 perf-overview, online serving (BF16)"
VLLM = "vLLM PR #7117 (2024-08-04), benchmark_throughput.py"


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    device: str
    requests: int
    rate: float | None           # requests/s; None: all at once
    isl: int
    osl: int
    published: dict[str, float]  # metric -> value: output_tok_s, req_s, ttft_mean_ms, itl_mean_ms


CASES = [
    Case("h100 128/128 offline", TRT_OFFLINE, "h100-80gb", 2000, None, 128, 128, {"output_tok_s": 15571.65}),
    Case("h100 2048/128 offline", TRT_OFFLINE, "h100-80gb", 1000, None, 2048, 128, {"output_tok_s": 1904.33}),
    Case("h100 1000/1000 offline", TRT_OFFLINE, "h100-80gb", 500, None, 1000, 1000, {"output_tok_s": 7054.52}),
    Case("a100 128/128 offline", TRT_OFFLINE, "a100-80gb", 2000, None, 128, 128, {"output_tok_s": 6701.80}),
    Case("a100 2048/128 offline", TRT_OFFLINE, "a100-80gb", 1000, None, 2048, 128, {"output_tok_s": 795.39}),
    Case("h100 256/256 offline (vLLM)", VLLM, "h100-80gb", 1000, None, 256, 256, {"req_s": 24.24}),
    Case("h100 467/256 at 2 req/s", TRT_ONLINE, "h100-80gb", 500, 2.0, 467, 256,
         {"output_tok_s": 504, "ttft_mean_ms": 23, "itl_mean_ms": 8}),
    Case("h100 467/256 at 8 req/s", TRT_ONLINE, "h100-80gb", 500, 8.0, 467, 256,
         {"output_tok_s": 1959, "ttft_mean_ms": 26, "itl_mean_ms": 9}),
    Case("h100 467/256 at 16 req/s", TRT_ONLINE, "h100-80gb", 500, 16.0, 467, 256,
         {"output_tok_s": 3765, "ttft_mean_ms": 30, "itl_mean_ms": 11}),
]


def predicted(case: Case) -> dict[str, float]:
    cfg = load_config({"model": {"name": "llama3-8b", "weights": "random", "dtype": "bfloat16"},
                       "backend": {"name": "torch"}, "scheduler": {"max_num_seqs": 256}})
    reqs = synthetic(case.requests, case.rate, [case.isl, case.isl], [case.osl, case.osl], 128256, seed=0)
    r = simulate(cfg, device_spec(case.device, "bfloat16"), reqs)["report"]
    return {"output_tok_s": r["output_tokens_per_s"], "req_s": r["requests"] / r["wall_s"],
            "ttft_mean_ms": r["ttft_s"]["mean"] * 1e3, "itl_mean_ms": r["itl_s"]["mean"] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="the cases whose name contains this")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    console = Console()
    t = Table(title="simulated against published (one engine config, default device figures)")
    for col in ("case", "metric", "published", "simulated", "sim / pub", "within 20%"):
        t.add_column(col, justify="right" if col not in ("case", "metric") else "left")
    rows = []
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        t0 = time.perf_counter()
        sim = predicted(case)
        host = time.perf_counter() - t0
        for metric, pub in case.published.items():
            ratio = sim[metric] / pub
            rows.append({"case": case.name, "source": case.source, "device": case.device, "metric": metric,
                         "published": pub, "simulated": sim[metric], "ratio": ratio, "host_s": host})
            t.add_row(case.name, metric, f"{pub:g}", f"{sim[metric]:.1f}", f"{ratio:.2f}",
                      "yes" if abs(ratio - 1) <= 0.2 else "[red]no[/]")
    console.print(t)
    met = sum(abs(r["ratio"] - 1) <= 0.2 for r in rows)
    console.print(f"{met} of {len(rows)} figures within 20%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
