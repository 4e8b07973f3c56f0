"""4-bit weights side by side with llama.cpp on the same GGUF file, in one run.

twophase runs the default model's GGUF blocks as they are (``quantization = "q4"``, ONNX
Runtime MatMulNBits) and, for reference, the dequantised fp32 model (onnxruntime and torch).
Where ``llama-cpp-python`` is installed (``pip install 'twophase[llama-cpp]'``: it compiles
llama.cpp, about 20 minutes on two cores), llama.cpp runs the same file with the same threads:
pp512 (one 512-token prompt) and tg128 (128 tokens at batch 1), flash attention on and off.
Rounds are interleaved; medians are printed with the ratios. Quality: perplexity on the shipped
text and greedy agreement with the fp32 model.

    python benchmarks/quantized.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from twophase import LLM
from twophase.bench import sweeps
from twophase.models import hub
from twophase.quality import greedy_agreement, perplexity, shipped_text

MODEL = "smollm2-135m-instruct"


def twophase_line(backend: str, quantization: str) -> LLM:
    return LLM.from_config({"model": {"name": MODEL, "quantization": quantization},
                            "backend": {"name": backend},
                            "scheduler": {"policy": "prefill-first", "max_num_batched_tokens": 512,
                                          "max_num_seqs": 32},
                            "cache": {"num_blocks": 1024}})


class LlamaCpp:
    def __init__(self, path: str, threads: int, flash: bool):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads,
                         flash_attn=flash, verbose=False)

    def pp(self, n: int, salt: int) -> float:
        tokens = [100 + (i * 7 + salt) % 40000 for i in range(n)]
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(tokens)
        return n / (time.perf_counter() - t)

    def tg(self, n: int, salt: int) -> float:
        self.llm.reset()
        self.llm.eval([100 + salt])
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([int(self.llm.sample(temp=0.0))])
        return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    lines = {"twophase q4 (onnxruntime)": twophase_line("onnxruntime", "q4"),
             "twophase fp32 (onnxruntime)": twophase_line("onnxruntime", "none"),
             "twophase fp32 (torch)": twophase_line("torch", "none")}
    cases = {"pp512": lambda llm, k: 512 / sweeps.prefill_round(llm, 512, 0, k),
             "tg batch 1": lambda llm, k: 1 / sweeps.decode_round(llm, 1, 128, 16, k),
             "tg batch 32": lambda llm, k: 32 / sweeps.decode_round(llm, 32, 128, 8, k)}
    engines: dict = dict(lines)
    try:
        gguf = str(hub.gguf_path(MODEL))
        for flash in (True, False):
            engines[f"llama.cpp (flash attention {'on' if flash else 'off'})"] = LlamaCpp(gguf, args.threads, flash)
    except ImportError:
        console.print("[yellow]llama-cpp-python is not installed: llama.cpp lines skipped "
                      "(pip install 'twophase\\[llama-cpp]'; it compiles for ~20 minutes)")
    rates = {name: {c: [] for c in cases} for name in engines}
    with console.status("measuring") as status:
        for k in range(args.rounds):
            for case, fn in cases.items():
                for name, eng in engines.items():
                    status.update(f"round {k + 1}/{args.rounds}: {case} on {name}")
                    if isinstance(eng, LlamaCpp):
                        if case == "tg batch 32":
                            continue                    # llama-cpp-python decodes one sequence
                        rates[name][case].append(eng.pp(512, k) if case == "pp512" else eng.tg(128, k))
                    else:
                        rates[name][case].append(fn(eng, k))
    first = next(iter(engines))
    table = Table(title=f"{MODEL}, CPU, {args.threads} threads: tokens/s, median of {args.rounds} "
                        f"interleaved rounds (ratio to {first})")
    table.add_column("engine")
    for case in cases:
        table.add_column(case, justify="right")
    base = {c: statistics.median(rates[first][c]) for c in cases}
    for name in engines:
        cells = []
        for c in cases:
            v = rates[name][c]
            cells.append(f"{statistics.median(v):.1f} (x{statistics.median(v) / base[c]:.2f})" if v else "-")
        table.add_row(name, *cells)
    console.print(table)
    text = shipped_text()
    ref, q4 = lines["twophase fp32 (torch)"], lines["twophase q4 (onnxruntime)"]
    p_ref, p_q4 = perplexity(ref, text), perplexity(q4, text)
    agree = greedy_agreement(q4, ref, ["The quick brown fox", "def fibonacci(n):",
                                       "Once upon a time", "The capital of France is"], 32)
    console.print(f"perplexity on the shipped text: fp32 {p_ref:.3f}, q4 {p_q4:.3f} "
                  f"({100 * (p_q4 / p_ref - 1):+.2f}%); greedy agreement with fp32 {100 * agree:.1f}%")


if __name__ == "__main__":
    main()
