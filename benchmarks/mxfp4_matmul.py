"""A 4-bit MXFP4 matrix (gpt-oss's experts' format) against Q4_0 of the same shape on the native
kernels' int8 paths: tokens/s of one projection, 1 row (a decode) and 64 rows (a prefill chunk),
the two types' calls interleaved in one process, median of the rounds.

    python benchmarks/mxfp4_matmul.py [--shape 2880x2880] [--rounds 7] [--threads 2]

Both store 32 values a block in 4-bit codes under one scale (Q4_0: an fp16 and an offset of 8,
18 bytes; MXFP4: a power of two and a codebook, 17 bytes); MXFP4 decodes its codes through a
16-entry table (one vpshufb a run) where Q4_0 subtracts its offset.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from twophase.backends.native import kernel
from twophase.formats import FORMATS


def rows_of(name: str, n: int, k: int, rng) -> np.ndarray:
    import gguf

    w = rng.normal(0, 0.02, (n, k)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2880x2880", help="rows x columns (gpt-oss's expert: 2880 x 2880)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    lib = kernel.load()
    rng = np.random.default_rng(0)
    mats = {name: rows_of(name, n, k, rng) for name in ("Q4_0", "MXFP4")}
    projs = {name: kernel.ProjStored(n, k, 1, (kernel.Part * 3)(kernel.Part(FORMATS[name].ggml_type, n,
                                                                            w.ctypes.data)))
             for name, w in mats.items()}
    print(f"one {n} x {k} projection on the native int8 paths, {args.threads} threads; "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'rows':>5} {'Q4_0 ms':>9} {'MXFP4 ms':>9} {'MXFP4 / Q4_0 speed':>19}")
    for rows in (1, 64):
        x = rng.normal(0, 1, (rows, k)).astype(np.float32)
        y = np.empty((rows, n), np.float32)
        scratch = np.empty(lib.check_scratch_floats(rows, k), np.float32)
        times: dict[str, list[float]] = {name: [] for name in projs}
        reps = 200 if rows == 1 else 10
        for _ in range(args.rounds):
            for name, proj in projs.items():
                lib.run_matmul_stored(ctypes.byref(proj), rows, x.ctypes.data, y.ctypes.data, scratch.ctypes.data,
                                      args.threads)
                t = time.perf_counter()
                for _ in range(reps):
                    lib.run_matmul_stored(ctypes.byref(proj), rows, x.ctypes.data, y.ctypes.data,
                                          scratch.ctypes.data, args.threads)
                times[name].append((time.perf_counter() - t) / reps)
        q4, mx = (1e3 * statistics.median(times[name]) for name in ("Q4_0", "MXFP4"))
        print(f"{rows:>5} {q4:>9.3f} {mx:>9.3f} {q4 / mx:>18.2f}x")


if __name__ == "__main__":
    main()
