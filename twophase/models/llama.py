"""The Llama family in one file (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU, tied
embeddings), with attention that reads and writes core's paged KV pool.

The pool is ``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``. Each forward first
writes the new tokens' K/V at their slots, then attends over the cached context. For a chunk that
follows cached tokens the causal mask is built from positions (key ``j`` is visible to a query at
position ``p`` iff ``j <= p``): ``is_causal=True`` aligns its mask top-left and would hide the
cached prefix, so it is used only for a chunk with nothing cached before it.

Tokens arrive packed (``[T]``); the q/k/v, o and MLP projections run once over all of them,
whatever mix of prefill chunks and decodes the step holds: one read of the weights a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twophase.models.graph_attention import GraphMeta, flat_gather, graph_attention
from twophase.models.shapes import LlamaArch


@dataclass
class AttnMeta:
    """Where each token's K/V goes and what it attends to, as device tensors.

    Decodes (one query each) are attended as one padded batch; each prefill chunk on its own.
    """

    slot_mapping: torch.Tensor            # [T] slots for the new K/V
    decode_idx: torch.Tensor | None       # [Bd] token indices of the one-token sequences
    decode_tables: torch.Tensor | None    # [Bd, nb] their block tables
    decode_lens: torch.Tensor | None      # [Bd] their context lengths (incl. the new token)
    # per prefill chunk: (first token index, chunk length, cached tokens before it, block table)
    chunks: list[tuple[int, int, int, torch.Tensor]]


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    """On the CPU always (a few floats), also inside a meta-device build, where arithmetic would
    run through torch's Python reference ops and import ``torch._dynamo`` (seconds)."""
    hd = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    s = arch.rope_scaling
    if not s:
        return inv
    # Llama-3: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, 1, hd] (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]          # slices, not chunk(): fewer graph nodes
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.h, self.kvh, self.hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        # q, k and v in one matmul: one weight read and one kernel call for all three
        self.qkv = nn.Linear(arch.hidden_size, (self.h + 2 * self.kvh) * self.hd,
                             bias=arch.attention_bias)
        self.o = nn.Linear(self.h * self.hd, arch.hidden_size, bias=arch.attention_bias)
        self.scale = self.hd ** -0.5

    def forward(self, x, cos, sin, kv_layer: torch.Tensor, meta: AttnMeta | GraphMeta) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv(x)
        nq, nkv = self.h * self.hd, self.kvh * self.hd
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        q = apply_rope(q.view(T, self.h, self.hd), cos, sin)
        k = apply_rope(k.view(T, self.kvh, self.hd), cos, sin)
        v = v.view(T, self.kvh, self.hd)
        if isinstance(meta, GraphMeta):        # traced for export: K/V are outputs, not writes
            meta.new_kv.append((k, v))
            return self.o(graph_attention(q, k, v, kv_layer, meta, self.scale).reshape(T, -1))
        write_kv(kv_layer, k, v, meta.slot_mapping)

        out = torch.empty_like(q)
        if meta.decode_idx is not None:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], kv_layer, meta)
        for first, n, start, table in meta.chunks:
            qs = q[first:first + n]
            if start == 0:   # nothing cached before this chunk: attend to its own K/V
                ks, vs = k[first:first + n], v[first:first + n]
            else:
                ks, vs = gather_kv(kv_layer, table.unsqueeze(0), start + n)
                ks, vs = ks[0].transpose(0, 1), vs[0].transpose(0, 1)
            out[first:first + n] = self._prefill(qs, ks, vs, start)
        return self.o(out.view(T, self.h * self.hd))

    def _prefill(self, q, k, v, start: int) -> torch.Tensor:
        """q: [n, H, hd]; k, v: [S, KVH, hd] with S = start + n. Mask from positions."""
        n, S = q.shape[0], k.shape[0]
        dt = q.dtype
        q, k, v = (t.transpose(0, 1).unsqueeze(0).to(dt) for t in (q, k, v))
        if start == 0:      # no cache before the chunk: plain causal, so fused kernels apply
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
        else:
            qpos = torch.arange(start, start + n, device=q.device)
            mask = torch.arange(S, device=q.device)[None, :] <= qpos[:, None]    # [n, S]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1)

    def _decode(self, q, kv_layer, meta: AttnMeta) -> torch.Tensor:
        """q: [B, H, hd], one query per sequence at the end of its context.

        Attends block by block on the gathered blocks ``[B, nb, KVH, BS, hd]`` without first
        making each sequence's K/V contiguous: that transpose-copy cost more than attention
        itself (2.7x slower per layer at batch 32, context 272 on CPU). The batch is cut into
        slices whose gathered K/V stay under ``DECODE_GATHER_BYTES``: padded to the longest
        context, 64 sequences of llama3-8b at 131,072 tokens would otherwise gather 34 GB."""
        tables, lens = meta.decode_tables, meta.decode_lens
        B, nb = tables.shape
        rows = decode_rows(B, nb * kv_layer.shape[-2], kv_layer.shape[2], kv_layer.shape[-1],
                           kv_layer.element_size())
        if rows >= B:
            return self._decode_rows(q, kv_layer, tables, lens)
        return torch.cat([self._decode_rows(q[i:i + rows], kv_layer, tables[i:i + rows], lens[i:i + rows])
                          for i in range(0, B, rows)])

    def _decode_rows(self, q, kv_layer, tables, lens) -> torch.Tensor:
        B, nb = tables.shape
        _, _, kvh, bs, hd = kv_layer.shape
        kv = flat_gather(kv_layer, tables)                               # [2, B, nb, KVH, BS, hd]
        qg = q.view(B, 1, kvh, self.h // kvh, hd)
        kv = kv.to(q.dtype)                                              # (a cache.dtype override)
        s = (qg @ kv[0].transpose(-1, -2)).float() * self.scale        # [B, nb, KVH, g, BS]
        pos = torch.arange(nb * bs, device=q.device).view(1, nb, 1, 1, bs)
        s = s.masked_fill(pos >= lens.view(B, 1, 1, 1, 1), torch.finfo(s.dtype).min)
        p = (s - s.amax(dim=(1, 4), keepdim=True)).exp()
        den = p.sum(dim=(1, 4)).unsqueeze(-1)                            # [B, KVH, g, 1]
        o = (p.to(kv.dtype) @ kv[1]).sum(1).float() / den                # [B, KVH, g, hd]
        return o.to(q.dtype).reshape(B, self.h, hd)


DECODE_GATHER_BYTES = 256 << 20     # the most K/V one decode slice gathers


def decode_rows(batch: int, context: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Sequences a decode attends at once: all, unless their K/V padded to ``context`` would
    gather more than ``DECODE_GATHER_BYTES`` (then as many as fit, at least one)."""
    per_row = 2 * context * kv_heads * head_dim * itemsize
    return max(1, min(batch, DECODE_GATHER_BYTES // per_row))


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_layer: [2, NB, KVH, BS, hd]; k, v: [T, KVH, hd]; slots: [T]."""
    bs = kv_layer.shape[-2]
    blocks, offs = slots // bs, slots % bs
    kv_layer[0, blocks, :, offs] = k.to(kv_layer.dtype)
    kv_layer[1, blocks, :, offs] = v.to(kv_layer.dtype)


def gather_kv(kv_layer: torch.Tensor, tables: torch.Tensor, length: int):
    """The first ``length`` cached tokens of each table's sequence: ([B, KVH, S, hd],) * 2."""
    B, nb = tables.shape
    _, _, kvh, bs, hd = kv_layer.shape
    kv = flat_gather(kv_layer, tables)
    kv = kv.permute(0, 1, 3, 2, 4, 5).reshape(2, B, kvh, nb * bs, hd)[:, :, :, :length]
    return kv[0], kv[1]


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.f = arch.intermediate_size
        self.gate_up = nn.Linear(arch.hidden_size, 2 * self.f, bias=arch.mlp_bias)
        self.down = nn.Linear(self.f, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate, up = gate_up[:, :self.f], gate_up[:, self.f:]
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(arch)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, cos, sin, kv_layer, meta):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Block(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                meta: AttnMeta) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; writes K/V into ``kv_pool``."""
        x = self.embed(token_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        for i, layer in enumerate(self.layers):
            if isinstance(meta, GraphMeta):     # graphs index the whole pool (see pool_gather)
                meta.layer = i
                x = layer(x, cos, sin, kv_pool, meta)
            else:
                x = layer(x, cos, sin, kv_pool[i], meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
