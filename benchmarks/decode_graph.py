"""What the decode-only graph (``twophase.exporters.decode_graph``) saves: one decode step of
the onnxruntime backend on the default model, through the step graph (``decode_graph = false``)
and through the decode graph, with ORT's threads spinning between ops (the backend's default)
and sleeping (``spinning = false``), interleaved, on the same batch.

    python benchmarks/decode_graph.py [--quantization q4|none] [--batch 1 8 32] [--context 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from twophase import LLM, SamplingParams
from twophase.contract import DecodeBatch
from twophase.core import batch


def engine(quantization: str, **options) -> LLM:
    return LLM.from_config({"model": {"name": "smollm2-135m-instruct", "quantization": quantization},
                            "backend": {"name": "onnxruntime", "options": options},
                            "cache": {"num_blocks": 2048}})


def decoding_batch(llm: LLM, size: int, context: int) -> DecodeBatch:
    """``size`` sequences of ``context`` to ``context + 2 * size`` prompt tokens, two tokens into
    their decode."""
    eng = llm.engine
    reqs = [eng.add_request([100 + (7 * i + j) % 40000 for j in range(context + 2 * i)],
                            SamplingParams(max_tokens=64, ignore_eos=True))
            for i in range(size)]
    while any(r.num_output_tokens < 2 for r in reqs):
        eng.step()
    return batch.decode_batch(eng.scheduler.schedule().decodes, eng.kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["q4", "none"], default="q4")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    args = ap.parse_args()
    lines = {"step graph": ({"decode_graph": False}, False),
             "decode graph": ({}, True),
             "decode graph, threads sleeping": ({"spinning": False}, True)}
    table = Table(title=f"one decode step, default model ({args.quantization}), contexts of about "
                        f"{args.context} tokens, onnxruntime on the CPU: ms, median of {args.rounds} "
                        f"interleaved rounds")
    for col in ("batch", *lines):
        table.add_column(col, justify="right")
    for size in args.batch:
        runs = {}
        for name, (options, uses_graph) in lines.items():
            llm = engine(args.quantization, **options)
            assert (llm.prefill_backend.decode_session is not None) == uses_graph, name
            runs[name] = (llm, decoding_batch(llm, size, args.context))
        times: dict[str, list[float]] = {name: [] for name in lines}
        for _ in range(args.rounds):
            for name, (llm, b) in runs.items():
                t = time.perf_counter()
                llm.prefill_backend.decode(b)
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["step graph"])
        table.add_row(str(size), *(f"{1000 * statistics.median(v):.2f} (x{base / statistics.median(v):.2f})"
                                   for v in times.values()))
    Console().print(table)


if __name__ == "__main__":
    main()
