"""One projection of each block type on the native backend's AMX bf16 tiles against its int8
paths, by the rows a step brings: where each type's tiles start to pay, and what a step of few
rows costs on them (decoding the weights into bf16 panels, once a step whatever its rows).

    python benchmarks/tile_types.py [--shape 16384x640] [--types Q8_0,Q5_0,Q4_1,Q4_0] [--rounds 7]

Both calls round the rows as a step rounds them (int8 runs, or bf16 for the tiles); the two
paths' calls interleaved in one process, medians of the rounds. Types the ``gguf`` package can
quantise (its K-quants it cannot: they run through ``amx_crossover.py``'s whole steps).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from twophase.backends.native import kernel
from twophase.formats import FORMATS

ROWS = (1, 8, 16, 24, 32, 48, 64, 128)


def main() -> None:
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="16384x640", help="rows x columns (a sixteenth of Gemma 3 270M's head)")
    ap.add_argument("--types", default="Q8_0,Q5_0,Q4_1,Q4_0")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    lib = kernel.load()
    if lib.amx_request() != 1:
        raise SystemExit("no AMX tiles here (CPU, compiler or kernel)")
    rng = np.random.default_rng(0)
    print(f"one {n} x {k} projection, {args.threads} threads: ms on the int8 paths / on the tiles, "
          f"medians of {args.rounds} interleaved rounds")
    for name in args.types.split(","):
        w = np.ascontiguousarray(gguf.quants.quantize(rng.normal(0, 0.02, (n, k)).astype(np.float32),
                                                      gguf.GGMLQuantizationType[name]))
        proj = kernel.ProjStored(n, k, 1, (kernel.Part * 3)(kernel.Part(FORMATS[name].ggml_type, n, w.ctypes.data)))
        cells = []
        for rows in ROWS:
            x = rng.normal(0, 1, (rows, k)).astype(np.float32)
            y = np.empty((rows, n), np.float32)
            scratch = np.empty(lib.check_scratch_floats(rows, k), np.float32)
            calls = {"int8": lib.run_matmul_stored, "tiles": lib.run_matmul_amx}
            times: dict[str, list[float]] = {path: [] for path in calls}
            for _ in range(args.rounds):
                for path, call in calls.items():
                    t = time.perf_counter()
                    call(ctypes.byref(proj), rows, x.ctypes.data, y.ctypes.data, scratch.ctypes.data, args.threads)
                    times[path].append(time.perf_counter() - t)
            a, b = (1e3 * statistics.median(times[path]) for path in calls)
            cells.append(f"{rows}: {a:.2f}/{b:.2f} x{a / b:.2f}")
        print(f"{name:>5}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
