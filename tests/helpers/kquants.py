"""Q4_K, Q5_K and Q6_K blocks of float rows, for test files: the ``gguf`` package decodes these
types but does not write them, and llama.cpp's quantiser is not a test dependency. A plain
min/max fit a run, in ggml's layouts (``ggml-common.h``); what a test checks is that a reader
decodes the bytes as ggml does, not how well they fit."""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums a block ``[nb, 8]`` as ggml packs them in 12 bytes."""
    q = np.zeros((len(sc), 12), np.uint8)
    q[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    q[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    q[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return q


def _affine(x: np.ndarray, levels: int):
    """Per run of 32 of the blocks ``[nb, 8, 32]``: codes, 6-bit scales and minimums, d, dmin."""
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, minimum = (hi - lo) / levels, -lo
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum(minimum.max(-1), 1e-12) / 63
    sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(minimum / dmin[:, None]), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(np.rint((x + (dmin16[:, None] * mn)[..., None]) / step), 0, levels).astype(np.uint8)
    return q, sc, mn, d, dmin


def quantize(rows: np.ndarray, name: str) -> np.ndarray:
    """``rows`` ``[n, k]`` (k a multiple of 256) as ``name``'s blocks: uint8 ``[n, bytes a row]``."""
    n, k = rows.shape
    x = rows.astype(np.float32).reshape(-1, 256)
    nb = len(x)
    if name in ("Q4_K", "Q5_K"):
        q, sc, mn, d, dmin = _affine(x.reshape(nb, 8, 32), 15 if name == "Q4_K" else 31)
        low = (q & 15).reshape(nb, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
        head = [_f16(d), _f16(dmin), _scales_k4(sc, mn)]
        if name == "Q4_K":
            out = np.concatenate([*head, qs], axis=1)
        else:
            high = (q >> 4).astype(np.uint8)                      # [nb, 8, 32]: bit j of byte l
            qh = np.zeros((nb, 32), np.uint8)
            for j in range(8):
                qh |= high[:, j] << j
            out = np.concatenate([*head, qh, qs], axis=1)
    elif name == "Q6_K":
        runs = x.reshape(nb, 16, 16)
        scale = np.abs(runs).max(-1) / 31
        d = np.maximum(np.abs(scale).max(-1), 1e-12) / 127
        sc = np.clip(np.rint(scale / d[:, None]), -128, 127).astype(np.int8)
        d16 = d.astype(np.float16).astype(np.float32)
        step = (d16[:, None] * sc)[..., None]
        q = (np.clip(np.rint(np.divide(runs, step, out=np.zeros_like(runs), where=step != 0)), -32, 31) + 32)
        q = q.astype(np.uint8).reshape(nb, 2, 4, 32)              # halves of 128, four runs of 32
        ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                             (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(nb, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(nb, 64)
        out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
    else:
        raise ValueError(name)
    return np.ascontiguousarray(out).reshape(n, -1)
