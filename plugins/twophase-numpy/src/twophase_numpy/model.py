"""A Llama forward pass in NumPy over twophase's paged KV pool, one sequence at a time.

Pool layout (twophase's contract): ``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``;
token ``t`` of a sequence lives in block ``table[t // block_size]`` at offset
``t % block_size``.
"""

from __future__ import annotations

import math

import numpy as np

from twophase.contract import ModelArch


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_frequencies(arch: ModelArch) -> np.ndarray:
    """Per pair of dimensions, radians per position; Llama-3 scaling blends long wavelengths."""
    hd = arch.head_dim
    inv = 1.0 / arch.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    s = arch.rope_scaling
    if not s:
        return inv
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:              # short wavelengths: unchanged
            out.append(f)
        elif wavelen > old / lo:            # long ones: slowed down by `factor`
            out.append(f / factor)
        else:                               # in between: a linear blend
            t = (old / wavelen - lo) / (hi - lo)
            out.append((1 - t) * f / factor + t * f)
    return np.array(out)


def rotate(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """x: [T, heads, hd]; the first and second halves of hd form the rotated pairs."""
    angles = positions[:, None].astype(np.float64) * freqs[None, :]        # [T, hd/2]
    cos = np.cos(angles)[:, None, :].astype(x.dtype)
    sin = np.sin(angles)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class NumpyLlama:
    def __init__(self, arch: ModelArch, weights: dict[str, np.ndarray]):
        self.arch, self.w = arch, weights
        self.freqs = rope_frequencies(arch)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                seqs: list[tuple[int, int, int, np.ndarray]], pool: np.ndarray) -> np.ndarray:
        """Hidden states ``[T, hidden]`` after the final norm. ``seqs``: per sequence (first
        token index, new tokens, tokens cached before them, block table). Writes each new
        token's K/V into ``pool`` at its slot."""
        a, w = self.arch, self.w
        H, KVH, hd = a.num_heads, a.num_kv_heads, a.head_dim
        bs = pool.shape[4]
        x = w["embed"][tokens]
        for i in range(a.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "attn_norm"], a.rms_norm_eps)
            q = (h @ w[p + "q"].T + w.get(p + "q_bias", 0)).reshape(-1, H, hd)
            k = (h @ w[p + "k"].T + w.get(p + "k_bias", 0)).reshape(-1, KVH, hd)
            v = (h @ w[p + "v"].T + w.get(p + "v_bias", 0)).reshape(-1, KVH, hd)
            q, k = rotate(q, positions, self.freqs), rotate(k, positions, self.freqs)
            pool[i, 0, slots // bs, :, slots % bs] = k
            pool[i, 1, slots // bs, :, slots % bs] = v
            out = np.empty_like(q)
            for first, n, cached, table in seqs:
                out[first:first + n] = self._attend(q[first:first + n], pool[i], table, cached)
            x = x + out.reshape(len(tokens), H * hd) @ w[p + "o"].T + w.get(p + "o_bias", 0)
            h = rms_norm(x, w[p + "mlp_norm"], a.rms_norm_eps)
            gate = h @ w[p + "gate"].T + w.get(p + "gate_bias", 0)
            up = h @ w[p + "up"].T + w.get(p + "up_bias", 0)
            x = x + (silu(gate) * up) @ w[p + "down"].T + w.get(p + "down_bias", 0)
        return rms_norm(x, w["norm"], a.rms_norm_eps)

    def _attend(self, q: np.ndarray, kv: np.ndarray, table: np.ndarray, cached: int) -> np.ndarray:
        """q: [n, H, hd] at positions cached..cached+n-1; kv: one layer of the pool."""
        n, H, hd = q.shape
        KVH, bs = kv.shape[2], kv.shape[3]                  # kv: [2, NB, KVH, BS, hd]
        length = cached + n
        t = np.arange(length)
        keys = kv[0, table[t // bs], :, t % bs]             # [S, KVH, hd]
        vals = kv[1, table[t // bs], :, t % bs]
        keys = np.repeat(keys, H // KVH, axis=1)            # each KV head serves H/KVH queries
        vals = np.repeat(vals, H // KVH, axis=1)
        scores = np.einsum("nhd,shd->hns", q, keys) / math.sqrt(hd)
        visible = t[None, :] <= (cached + np.arange(n))[:, None]       # [n, S] causal
        scores = np.where(visible[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        return np.einsum("hns,shd->nhd", probs, vals)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return hidden @ self.w["lm_head"].T
