"""What storing K/V in fewer bits costs in predictions: for each ``cache.dtype``, the mean KL
divergence of the next-token distributions from the float32 cache's, over the same text, and
how often the top token agrees; beside llama.cpp's own figure for its f16, q8_0 and q4_0 caches
against its f32 cache, on the same GGUF file and the same token ids, measured the same way
(logits at every position, batches of 512, flash attention on: llama.cpp needs it for a
quantised V cache). twophase runs the file dequantised (float32 weights) on torch, and its
blocks as stored on the native backend (``quantization = "gguf"``, each of the caches it reads);
llama.cpp runs its blocks: each measures its cache against its own float32 cache on its own
weights. One more line, native's float32 cache against torch's: how far native's arithmetic
(8-bit or bf16 activations on the blocks) already is before any cache rounding.

    python benchmarks/kv_quality.py [--tokens 1024] [--llama-python /path/to/python] [--no-native]

``--llama-python``: an interpreter that has ``llama-cpp-python`` (it compiles llama.cpp; a venv
of its own keeps this one's packages as they are); without it only twophase's lines print.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from twophase import LLM
from twophase.measure.quality import all_logits, shipped_text
from twophase.models import hub

MODEL = "smollm2-135m-instruct"

LLAMA = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}          # ggml_type ids
logits = {}
for name, t in TYPES.items():
    llm = Llama(model_path=path, n_ctx=len(ids) + 16, n_batch=512, n_ubatch=512, n_threads=threads,
                flash_attn=True, logits_all=True, type_k=t, type_v=t, verbose=False)
    llm.eval(ids)
    logits[name] = np.array(llm.scores[:len(ids)], dtype=np.float32)
for name, x in logits.items():
    np.save(f"{sys.argv[4]}/{name}.npy", x)
"""


def kl_and_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    ref_lp, lp = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == got.argmax(-1)).float().mean())


def logits(ids: list[int], fmt: str, native: bool = False) -> torch.Tensor:
    model = {"name": MODEL, "quantization": "gguf"} if native else {"name": MODEL}
    llm = LLM.from_config({"model": model, "cache": {"dtype": fmt, "num_blocks": 256},
                           "backend": {"name": "native" if native else "torch"},
                           "scheduler": {"max_num_batched_tokens": 512}})
    return torch.cat([x for _, x in all_logits(llm, ids, 512)])


def ours(ids: list[int], native: bool = False) -> dict[str, tuple[float, float]]:
    ref = logits(ids, "float32", native)
    formats = ("float16", "bfloat16", "int8") if native else ("float16", "bfloat16", "int8", "fp8")
    return {fmt: kl_and_top1(ref, logits(ids, fmt, native)) for fmt in formats}


def llama_cpp(python: str, ids: list[int], threads: int) -> dict[str, tuple[float, float]]:
    import tempfile

    import numpy as np

    path = str(hub.gguf_path(MODEL))
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([python, "-c", LLAMA, path, json.dumps(ids), str(threads), d], check=True)
        ref = torch.from_numpy(np.load(f"{d}/f32.npy"))
        return {t: kl_and_top1(ref, torch.from_numpy(np.load(f"{d}/{t}.npy"))) for t in ("f16", "q8_0", "q4_0")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    ap.add_argument("--no-native", action="store_true", help="leave out the native backend's lines")
    args = ap.parse_args()
    ref = LLM.from_config({"model": {"name": MODEL}, "cache": {"num_blocks": 16}})
    ids = ref.tokenizer.encode(shipped_text())[:args.tokens]
    del ref
    rows = [("twophase", fmt, *v) for fmt, v in ours(ids).items()]
    if not args.no_native:
        rows += [("native", fmt, *v) for fmt, v in ours(ids, native=True).items()]
        rows.append(("native", "f32/torch", *kl_and_top1(logits(ids, "float32"), logits(ids, "float32", True))))
    if args.llama_python:
        rows += [("llama.cpp", t, *v) for t, v in llama_cpp(args.llama_python, ids, args.threads).items()]
    print(f"{len(ids)} tokens of twophase/data/prose.txt, {MODEL}; KL from each engine's float32 cache")
    print(f"{'engine':<10} {'cache':<9} {'mean KL':>10} {'top-1 agree':>12}")
    for engine, fmt, kl, top1 in rows:
        print(f"{engine:<10} {fmt:<9} {kl:>10.6f} {top1:>12.4f}")


if __name__ == "__main__":
    sys.exit(main())
