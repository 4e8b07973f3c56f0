"""Long-context decode over K/V in 32, 16 and 8 bits, beside llama.cpp at the same depth.

Decode reads every running sequence's whole K/V each step: after a 4,096-token prompt the
default model's float32 K/V (188 MB a sequence) outweigh its 4-bit weights (105 MB). Lines:
twophase's native step on the GGUF's blocks over a pool of ``float32``, ``float16`` and ``int8``
(q8_0 rows), and llama.cpp (llama-cpp-python) on the same file with f16 and q8_0 K/V, flash
attention on (it needs it for a quantised V cache), through its batch API as llama-batched-bench
runs it. Each engine runs in a process of its own, rounds interleaved; medians of tokens a second
over the decode steps after the prompts.

    python benchmarks/kv_speed.py [--context 4096] [--batches 1,8] [--rounds 3]
                                  [--llama-python /path/to/python-with-llama-cpp-python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

STEPS = 16


def twophase_worker(fmt: str, context: int, threads: int) -> None:
    from twophase import LLM, SamplingParams
    from twophase.measure.phase_timing import decode_prompts, decode_round

    blocks = 9 * (context + STEPS + 32) // 16 + 64       # batch 8 and batch 1's cached prompts
    llm = LLM.from_config({"model": {"quantization": "q4"},
                           "backend": {"name": "native", "options": {"threads": threads}},
                           "cache": {"dtype": fmt, "num_blocks": blocks, "block_size": 16},
                           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 512}})
    warm: set[int] = set()

    def measure(batch: int) -> float:
        if batch not in warm:       # the prompts into the prefix cache, so all decode together
            prompts = decode_prompts(batch, context, llm.model.arch.vocab_size)
            llm.generate(prompts, SamplingParams(max_tokens=1))
            warm.add(batch)
        return batch / decode_round(llm, batch, context, STEPS, 0)

    serve(measure)


def llama_worker(kv: str, context: int, threads: int, path: str) -> None:
    import time

    import llama_cpp as lc

    types = {"f16": 1, "q8_0": 8}
    holder = lc.Llama(model_path=path, n_ctx=16, verbose=False)     # owns the weights: kept alive
    model = holder.model
    contexts = {}

    def context_for(batch: int):
        if batch not in contexts:
            p = lc.llama_context_default_params()
            p.n_ctx = batch * (context + STEPS + 8)
            p.n_batch = p.n_ubatch = 512
            p.n_seq_max = batch
            p.kv_unified = False       # a stream a sequence: each attends to its own K/V only
            p.n_threads = p.n_threads_batch = threads
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
            p.type_k = p.type_v = types[kv]
            contexts[batch] = lc.llama_init_from_model(model, p)
        return contexts[batch]

    b = lc.llama_batch_init(512, 0, 1)

    def run(ctx, items) -> None:
        for start in range(0, len(items), 512):
            chunk = items[start:start + 512]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, out) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
                b.seq_id[i][0] = seq
            if lc.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
        lc.llama_synchronize(ctx)

    def measure(batch: int) -> float:
        fresh = batch not in contexts
        ctx = context_for(batch)
        if fresh:       # the prompts once; later rounds drop only what the last one decoded
            run(ctx, [(100 + (s * 131 + p * 7) % 40000, p, s, p == context - 1)
                      for s in range(batch) for p in range(context)])
        lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), -1, context, -1)
        times = []
        for k in range(STEPS):
            t = time.perf_counter()
            run(ctx, [(100 + (s * 13 + k) % 40000, context + k, s, True) for s in range(batch)])
            times.append(time.perf_counter() - t)
        return batch / statistics.median(times[1:])

    serve(measure)


def serve(measure) -> None:
    """Answer each batch size read from stdin with the tokens a second measured at it."""
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        print(json.dumps(measure(int(line))), flush=True)


class Worker:
    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.read() == "ready"

    def read(self):
        line = self.proc.stdout.readline()      # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"worker {self.proc.args} ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def __call__(self, batch: int) -> float:
        self.proc.stdin.write(f"{batch}\n")     # type: ignore[union-attr]
        self.proc.stdin.flush()                 # type: ignore[union-attr]
        return self.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, fmt = args.worker
        if kind == "twophase":
            return twophase_worker(fmt, args.context, args.threads)
        return llama_worker(fmt, args.context, args.threads, args.gguf)
    me = [str(Path(__file__).resolve()), "--context", str(args.context), "--threads", str(args.threads)]
    lines = {f"twophase native, {f} K/V": Worker([sys.executable, *me, "--worker", "twophase", f])
             for f in ("float32", "float16", "int8")}
    if args.llama_python:
        from twophase.models import hub

        gguf = str(hub.gguf_path("smollm2-135m-instruct"))
        for kv in ("f16", "q8_0"):
            lines[f"llama.cpp, {kv} K/V"] = Worker([args.llama_python, *me, "--worker", "llama", kv, "--gguf", gguf])
    batches = [int(b) for b in args.batches.split(",")]
    got: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, w in lines.items():
                got.setdefault((name, batch), []).append(w(batch))
    print(f"decode after a {args.context}-token prompt, default model's GGUF, {args.threads} threads, "
          f"median of {args.rounds} rounds (tokens/s)")
    print(f"{'line':<28}" + "".join(f"{f'batch {b}':>12}" for b in batches))
    for name in lines:
        print(f"{name:<28}" + "".join(f"{statistics.median(got[name, b]):>12.1f}" for b in batches))


if __name__ == "__main__":
    sys.exit(main())
