"""Multi-head latent attention (DeepSeek V2/V3) over core's paged pool, whose rows here are one
latent a token: ``[kv_lora_rank normed values | qk_rope_head_dim rotated key]``, shared by every
head (the pool's layer ``[1, NB, 1, BS, latent_dim]``: one plane, one "head").

Two ways to attend to it, picked by phase:

- *expanded* (prefill chunks): ``kv_b`` turns the context's latents into every head's keys and
  values, then plain attention. Compute-bound work on wide matmuls; its cost grows with the
  context times the heads, which a prefill pays once.
- *absorbed* (decodes): ``kv_b``'s key half is folded into the query (``q_nope W_uk``) and its
  value half into the output (``o_lat W_uv``), so a decode attends over the latents as they lie:
  a dot of ``kv_lora_rank + qk_rope_head_dim`` values a cached token, read once for every head,
  instead of reading (or recomputing) every head's keys and values. This is the memory-bound
  phase's form: bytes a token of context fall from ``2 heads head_dim`` to ``latent_dim``.

Both are the same function of the latents (``tests/models/test_deepseek.py`` checks them against
each other and against transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twophase.arch import ModelArch
from twophase.kv_formats import kv_format_of
from twophase.models.graph_attention import GraphMeta, chunk_visible, dec_invalid
from twophase.models.layers.attention import AttnMeta
from twophase.models.layers.norm import RMSNorm
from twophase.models.layers.rotary import apply_rope

LATENT_NORM_EPS = 1e-6     # transformers' default for the q and kv latents' norms, whatever the config's


class LatentAttention(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        m = arch.mla
        assert m is not None
        self.m, self.h, self.scale = m, arch.num_heads, arch.scale
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a = nn.Linear(arch.hidden_size, m.q_lora_rank, bias=arch.qkv_bias)
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = nn.Linear(m.q_lora_rank, self.h * qk, bias=False)
        else:
            self.q = nn.Linear(arch.hidden_size, self.h * qk, bias=False)
        self.kv_a = nn.Linear(arch.hidden_size, m.latent_dim, bias=arch.qkv_bias)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b = nn.Linear(m.kv_lora_rank, self.h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o = nn.Linear(self.h * m.v_head_dim, arch.hidden_size, bias=arch.o_bias)

    def forward(self, x, cos, sin, kv_layer: torch.Tensor, meta: AttnMeta | GraphMeta) -> torch.Tensor:
        m, T = self.m, x.shape[0]
        nope, r = m.qk_nope_head_dim, m.qk_rope_head_dim
        q = (self.q_b(self.q_a_norm(self.q_a(x))) if m.q_lora_rank else self.q(x)).view(T, self.h, nope + r)
        q_nope, q_pe = q[..., :nope], apply_rope(self._halves(q[..., nope:]), cos, sin)
        ckv = self.kv_a(x)
        k_pe = apply_rope(self._halves(ckv[:, None, m.kv_lora_rank:]), cos, sin)[:, 0]
        latent = torch.cat([self.kv_a_norm(ckv[:, :m.kv_lora_rank]), k_pe], dim=-1)     # [T, latent_dim]
        if isinstance(meta, GraphMeta):     # traced for export: the latents are an output, not a write
            meta.new_kv.append((latent[:, None], latent[:, None]))
            return self.o(self.graph(q_nope, q_pe, latent, kv_layer, meta).reshape(T, -1))
        write_latent(kv_layer, latent, meta.slot_mapping)

        out = x.new_empty(T, self.h, m.v_head_dim)
        if meta.decode_idx is not None:
            out[meta.decode_idx] = self.absorbed(q_nope[meta.decode_idx], q_pe[meta.decode_idx], kv_layer,
                                                 meta.decode_tables, meta.decode_lens)
        for first, n, start, table in meta.chunks:
            if start == 0:          # nothing cached before: its own latents, as the pool holds them
                ctx = latent[first:first + n]
                if kv_layer.dtype != ctx.dtype:
                    fmt = kv_format_of(kv_layer.dtype)
                    ctx = fmt.decode(fmt.encode(ctx), ctx.dtype)
            else:
                ctx = gather_latents(kv_layer, table.unsqueeze(0), x.dtype)[0, :start + n]
            out[first:first + n] = self.expanded(q_nope[first:first + n], q_pe[first:first + n], ctx, start)
        return self.o(out.reshape(T, -1))

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved rotary pairs (x0, x1), (x2, x3), ... laid out as halves (x0, x2, ... | x1,
        x3, ...), which the rotary kit rotates: one permutation of q and k leaves q.k as it is."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.m.rope_interleaved else x

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b``'s key half ``[H, nope, kv_lora]`` and value half ``[H, v, kv_lora]``."""
        m = self.m
        w = self.kv_b.weight.view(self.h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def _heads(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys ``[..., S, H, qk]`` and values ``[..., S, H, v]`` made from the
        latents ``ctx [..., S, latent_dim]``: the rotary key is shared by every head."""
        m = self.m
        kv = self.kv_b(ctx[..., :m.kv_lora_rank]).unflatten(-1, (self.h, m.qk_nope_head_dim + m.v_head_dim))
        k_pe = ctx[..., None, m.kv_lora_rank:].expand(*kv.shape[:-1], m.qk_rope_head_dim)
        return torch.cat([kv[..., :m.qk_nope_head_dim], k_pe], dim=-1), kv[..., m.qk_nope_head_dim:]

    def expanded(self, q_nope, q_pe, ctx: torch.Tensor, start: int) -> torch.Tensor:
        """A chunk of ``n`` queries after ``start`` cached tokens over its context's latents
        ``ctx [start + n, latent_dim]``: every head's keys and values made from them."""
        S, n = ctx.shape[0], q_nope.shape[0]
        k, v = self._heads(ctx)
        q = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def absorbed(self, q_nope, q_pe, kv_layer, tables, lens) -> torch.Tensor:
        """One query a sequence (``[B, H, ...]``) over its cached latents."""
        ctx = gather_latents(kv_layer, tables, q_nope.dtype)                      # [B, S, latent_dim]
        hidden = torch.arange(ctx.shape[1], device=ctx.device)[None, None, :] >= lens.view(-1, 1, 1)
        return self._absorbed(q_nope, q_pe, ctx, hidden)

    def _absorbed(self, q_nope, q_pe, ctx: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``kv_b`` folded into the query and the output: scores ``(q_nope W_uk) . c + q_pe .
        k_pe``, output ``(p c) W_uv``; ``ctx [B, S, latent_dim]``, ``hidden [B, 1, S]`` the
        latents a query does not see."""
        m = self.m
        w_uk, w_uv = self._kv_b()
        c, k_pe = ctx[..., :m.kv_lora_rank], ctx[..., m.kv_lora_rank:]
        # batched matmuls, not einsums: ONNX Runtime's Einsum dies (SIGFPE) on a batch of 0 (no decodes)
        q_lat = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1)                       # [B, H, kv_lora]
        s = (q_lat @ c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)).float() * self.scale   # [B, H, S]
        p = torch.softmax(s.masked_fill(hidden, torch.finfo(s.dtype).min), dim=-1).to(c.dtype)
        return ((p @ c).transpose(0, 1) @ w_uv.transpose(1, 2)).transpose(0, 1)       # [B, H, v]

    def graph(self, q_nope, q_pe, latent, pool: torch.Tensor, meta: GraphMeta) -> torch.Tensor:
        """A step as one static dataflow (``graph_attention``'s groups over a latent pool
        ``[S, 1, NB, 1, BS, latent_dim]``): decodes absorbed over their cached latents and their
        own, chunks expanded over their cached latents and the chunk's; row ``T`` is zeros,
        where padding slots read and write."""
        T, H = q_nope.shape[:2]
        qn, qp, lat = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (q_nope, q_pe, latent))
        out = q_nope.new_zeros(T + 1, H, self.m.v_head_dim)
        bs = pool.shape[4]
        if meta.dec_index is not None:
            D, Wd = meta.dec_blocks.shape[1:]
            ctx = torch.cat([_pool_latents(pool, meta.dec_blocks[meta.layer], lat.dtype),
                             lat.index_select(0, meta.dec_index).unsqueeze(1)], dim=1)      # [D, Wd BS + 1, R]
            hidden = meta.shared("latent_dec_hidden", lambda: torch.cat(
                [dec_invalid(meta, Wd, bs, None, lat.device).reshape(D, 1, Wd * bs),
                 torch.zeros(D, 1, 1, dtype=torch.bool, device=lat.device)], dim=-1))
            out = out.index_copy(0, meta.dec_index, self._absorbed(qn.index_select(0, meta.dec_index),
                                                                   qp.index_select(0, meta.dec_index), ctx, hidden))
        if meta.chunk_index is not None:
            out = out.index_copy(0, meta.chunk_index.reshape(-1), self._graph_chunks(qn, qp, lat, pool, meta))
        return out[:T]

    def _graph_chunks(self, qn, qp, lat, pool: torch.Tensor, meta: GraphMeta) -> torch.Tensor:
        """Padded chunks ``[C, Q]`` over [cached latents | the chunk's own], expanded."""
        C, Q = meta.chunk_index.shape
        width = meta.chunk_blocks.shape[2] * pool.shape[4]
        idx = meta.chunk_index.reshape(-1)
        ctx = torch.cat([_pool_latents(pool, meta.chunk_blocks[meta.layer], lat.dtype),
                         lat.index_select(0, idx).reshape(C, Q, lat.shape[-1])], dim=1)               # [C, S + Q, R]
        k, v = self._heads(ctx)
        q = torch.cat([qn.index_select(0, idx), qp.index_select(0, idx)], dim=-1)
        q = q.reshape(C, Q, self.h, qn.shape[-1] + qp.shape[-1])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                                 # [C, H, ., .]
        s = (q @ k.transpose(-1, -2)).float() * self.scale                                # [C, H, Q, S + Q]
        visible = meta.shared("latent_chunk_visible",
                              lambda: chunk_visible(meta, width, Q, lat.device).reshape(C, 1, Q, width + Q))
        p = torch.softmax(s.masked_fill(~visible, torch.finfo(s.dtype).min), dim=-1).to(v.dtype)
        return (p @ v).transpose(1, 2).reshape(C * Q, self.h, self.m.v_head_dim)


def _pool_latents(pool: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, W BS, latent_dim]``: the latents of blocks ``[B, W]``, indices of the pool's
    ``S * NB`` blocks (``graph.inputs.layer_blocks``), as a graph reads them (a cast, no format)."""
    bs, row = pool.shape[-2], pool.shape[-1]
    every = pool.reshape(-1, bs, row)                                          # [S NB, BS, R]
    rows = every.index_select(0, blocks.reshape(-1)).to(dtype)
    # no -1 beside a dimension that may be 0 (no decodes, or no chunks): ONNX Runtime's Reshape divides by it
    return rows.reshape(blocks.shape[0], blocks.shape[1] * bs, row)


def write_latent(kv_layer: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_layer: ``[1, NB, 1, BS, row]``; latent: ``[T, latent_dim]``; slots: ``[T]``."""
    bs = kv_layer.shape[-2]
    kv_layer[0, slots // bs, 0, slots % bs] = kv_format_of(kv_layer.dtype).encode(latent)


def gather_latents(kv_layer: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each table's blocks' latents in order, ``[B, nb * BS, latent_dim]`` in ``dtype``."""
    B, nb = tables.shape
    rows = kv_layer[0].index_select(0, tables.reshape(-1))                     # [B nb, 1, BS, row]
    rows = kv_format_of(kv_layer.dtype).decode(rows, dtype)
    return rows.reshape(B, nb * rows.shape[-2], rows.shape[-1])
