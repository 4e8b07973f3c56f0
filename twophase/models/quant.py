"""Block-quantised weights in one representation, whatever their source.

A matrix ``W [N, K]`` (out × in) is cut into blocks of 32 along K; each block has integer codes
``q``, a scale ``d`` and an optional minimum ``m``: ``w = d * (q - zero) + m``. Sources:

- GGUF ``Q4_1`` (the default model's projections): 4-bit codes, ``w = d*q + m``, taken exactly.
- GGUF ``Q8_0`` (its tied embedding / output head): signed 8-bit codes, ``w = d*q``, stored
  here as ``q + 128`` with zero 128, exactly.
- A float matrix (HF folders, random weights): quantised here, the projections to 4 bits like
  Q4_1 (per-block minimum and step), the output head to 8 bits like Q8_0 (as llama.cpp keeps
  it: at 4 bits the head alone cost the default model 6% perplexity).

``pack`` lays codes out for ONNX Runtime's ``MatMulNBits``. ggml packs elements ``j`` and
``j + 16`` of a block into one byte; ``MatMulNBits`` packs neighbours ``2j`` and ``2j + 1``
(low nibble first): the codes are unpacked to one per byte first, so repacking is a plain
re-pairing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32


@dataclass
class QWeight:
    codes: np.ndarray            # uint8 [N, K], one code per element
    scale: np.ndarray            # float32 [N, K/32]
    minimum: np.ndarray | None   # float32 [N, K/32] (Q4_1), or None
    bits: int                    # 4 or 8
    # the code that means 0: one for all blocks (0 for Q4_1 with its minimum, 128 for Q8_0), or
    # uint8 [N, K/32], one per block (see ``centered``)
    zero: int | np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def zeros(self) -> np.ndarray:
        """The zero point of every block, uint8 ``[N, K/32]``."""
        N, K = self.codes.shape
        return np.broadcast_to(np.asarray(self.zero, dtype=np.uint8), (N, K // BLOCK))

    def dequantize(self) -> np.ndarray:
        N, K = self.codes.shape
        q = self.codes.reshape(N, K // BLOCK, BLOCK).astype(np.float32) \
            - self.zeros()[:, :, None].astype(np.float32)
        w = self.scale[:, :, None] * q
        if self.minimum is not None:
            w = w + self.minimum[:, :, None]
        return w.reshape(N, K)

    def rows(self, order: np.ndarray) -> "QWeight":
        """The same weight with its rows (output features) reordered."""
        zero = self.zero if np.ndim(self.zero) == 0 else self.zero[order]
        return QWeight(self.codes[order], self.scale[order],
                       None if self.minimum is None else self.minimum[order], self.bits, zero)

    def centered(self) -> "QWeight":
        """The same weights with each block's zero point moved to the code nearest its minimum's
        zero, ``z = rint(-m/d)``, and the minimum reduced to the rest, ``m + z*d``:
        ``d*q + m = d*(q - z) + (m + z*d)``: the same weights (the terms are exact in float32 for
        fp16 ``d`` and ``m`` and a 4-bit ``z``; their sum rounds once either way).

        Why: a kernel that rounds activations to int8 (ONNX Runtime's ``accuracy_level`` 4, like
        llama.cpp's Q8_1) multiplies that rounding error by the weights it sees. With ``z = 0``
        it sees ``d*q``, all of one sign and about 8 steps from zero, and the minimum, added
        exactly, no longer cancels the error; centred, it sees weights near their true values."""
        if self.minimum is None or np.ndim(self.zero):
            return self
        limit = (1 << self.bits) - 1
        safe = np.where(self.scale > 0, self.scale, 1)
        z = np.clip(np.rint(-self.minimum / safe), 0, limit).astype(np.uint8)
        rest = (self.minimum + z.astype(np.float32) * self.scale).astype(np.float32)
        return QWeight(self.codes, self.scale, rest, self.bits, z)

    @staticmethod
    def stack(parts: list["QWeight"]) -> "QWeight":
        """Rows of several weights one after another (fused projections)."""
        first = parts[0]
        assert all(p.bits == first.bits for p in parts)
        mins = [p.minimum for p in parts]
        same = all(np.ndim(p.zero) == 0 and p.zero == first.zero for p in parts)
        return QWeight(np.concatenate([p.codes for p in parts]),
                       np.concatenate([p.scale for p in parts]),
                       None if any(m is None for m in mins) else np.concatenate(mins),
                       first.bits, first.zero if same else np.concatenate([p.zeros() for p in parts]))


def from_q4_1(raw: np.ndarray, n: int, k: int) -> QWeight:
    """GGUF Q4_1 bytes of an ``[n, k]`` matrix: blocks of (fp16 d, fp16 m, 16 bytes of codes)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 20)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[:, :, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)       # elements j, then j + 16
    return QWeight(codes.reshape(n, k), d, m, 4, 0)


def from_q8_0(raw: np.ndarray, n: int, k: int) -> QWeight:
    """GGUF Q8_0 bytes: blocks of (fp16 d, 32 signed codes); stored as ``code + 128``."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, 34)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8).astype(np.int16) + 128
    return QWeight(q.astype(np.uint8).reshape(n, k), d, None, 8, 128)


def quantize_q4(w: np.ndarray) -> QWeight:
    """4-bit codes with a per-block minimum and step (Q4_1's scheme) for a float matrix."""
    n, k = w.shape
    b = np.asarray(w, dtype=np.float32).reshape(n, k // BLOCK, BLOCK)
    lo, hi = b.min(-1), b.max(-1)
    d = (hi - lo) / 15
    safe = np.where(d > 0, d, 1)
    codes = np.clip(np.rint((b - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return QWeight(codes.reshape(n, k), d.astype(np.float32), lo.astype(np.float32), 4, 0)


def quantize_q8(w: np.ndarray) -> QWeight:
    """8-bit symmetric codes per block (Q8_0's scheme), for the output head."""
    n, k = w.shape
    b = np.asarray(w, dtype=np.float32).reshape(n, k // BLOCK, BLOCK)
    d = np.abs(b).max(-1) / 127
    safe = np.where(d > 0, d, 1)
    codes = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int16) + 128
    return QWeight(codes.astype(np.uint8).reshape(n, k), d.astype(np.float32), None, 8, 128)


def pack(qw: QWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``MatMulNBits`` inputs: B ``uint8 [N, K/32, 32*bits/8]``, scales ``float32 [N*K/32]``,
    zero points ``uint8`` (4 bits: two blocks a byte, low nibble first; 8 bits: one a byte)."""
    n, k = qw.codes.shape
    nb = k // BLOCK
    c = qw.codes.reshape(n, nb, BLOCK)
    zp = qw.zeros()
    if qw.bits == 4:
        b = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)           # neighbours paired
        zp = np.pad(zp, ((0, 0), (0, nb % 2)))
        zeros = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    else:
        b = c.astype(np.uint8)
        zeros = np.ascontiguousarray(zp).reshape(-1)
    return np.ascontiguousarray(b), np.ascontiguousarray(qw.scale.reshape(-1)), zeros
