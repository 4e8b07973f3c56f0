"""Attention over core's paged KV pool, with what the families add: q/k/v and output
biases, per-head QK-norm, a query scale, logit soft-capping, sliding windows and sinks (a
learned logit a head that joins every softmax's denominator and takes no value: gpt-oss).

The pool is ``[layers, 2, num_blocks, kv_heads, block_size, row]``, a row being one head's vector
as ``cache.dtype`` stores it (``twophase/kv_formats.py``: the values, or int8 codes and scales),
read and written only through the format's ``decode``/``encode``. Each forward first
writes the new tokens' K/V at their slots, then attends over the cached context. For a chunk that
follows cached tokens the causal mask is built from positions (key ``j`` is visible to a query at
position ``p`` iff ``j <= p``, and ``j > p - window`` in a sliding layer): ``is_causal=True``
aligns its mask top-left and would hide the cached prefix, so it is used only for a chunk with
nothing cached before it in a full-attention layer without soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twophase.arch import AttentionSpec, ModelArch
from twophase.kv_formats import kv_format_of
from twophase.models.graph_attention import GraphMeta, Scores, flat_gather, graph_attention
from twophase.models.layers.norm import RMSNorm
from twophase.models.layers.rotary import apply_rope


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


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, spec: AttentionSpec):
        super().__init__()
        self.h, self.kvh, self.hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        # q, k and v in one matmul: one weight read and one kernel call for all three
        # (with an output gate, q_proj gives each head's query and then its gate)
        self.gated = arch.attn_output_gate
        q_rows = self.h * self.hd * (2 if self.gated else 1)
        self.qkv = nn.Linear(arch.hidden_size, q_rows + 2 * self.kvh * self.hd, bias=arch.qkv_bias)
        self.o = nn.Linear(self.h * self.hd, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.hd, arch.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.hd, arch.rms_norm_eps, arch.norm_offset)
        self.qk_norm = arch.qk_norm
        self.scale = arch.scale
        self.softcap = arch.attn_softcap
        self.window = spec.window
        self.rope = not arch.no_rope
        self.sinks = nn.Parameter(torch.empty(self.h)) if arch.attn_sinks else None

    def forward(self, x, cos, sin, kv_layer: torch.Tensor, meta: AttnMeta | GraphMeta) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv(x)
        nq, nkv = self.h * self.hd * (2 if self.gated else 1), self.kvh * self.hd
        q = qkv[:, :nq].view(T, self.h, -1)
        gate = None
        if self.gated:
            q, gate = q[..., :self.hd], q[..., self.hd:].reshape(T, self.h * self.hd)
        k = qkv[:, nq:nq + nkv].view(T, self.kvh, self.hd)
        v = qkv[:, nq + nkv:].view(T, self.kvh, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(meta, GraphMeta):        # traced for export: K/V are outputs, not writes
            meta.new_kv.append((k, v))
            scores = Scores(self.scale, self.softcap, self.window)
            return self._out(graph_attention(q, k, v, kv_layer, meta, scores, self.sinks).reshape(T, -1), gate)
        write_kv(kv_layer, k, v, meta.slot_mapping)

        out = torch.empty_like(q)
        if meta.decode_idx is not None:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], kv_layer, meta)
        for first, n, start, table in meta.chunks:
            qs = q[first:first + n]
            if start == 0:   # nothing cached before this chunk: attend to its own K/V
                ks, vs = k[first:first + n], v[first:first + n]
                if kv_layer.dtype != k.dtype:     # as the pool holds them, whatever the chunking
                    fmt = kv_format_of(kv_layer.dtype)
                    ks, vs = (fmt.decode(fmt.encode(t), q.dtype) for t in (ks, vs))
            else:
                ks, vs = gather_kv(kv_layer, table.unsqueeze(0), start + n, q.dtype)
                ks, vs = ks[0].transpose(0, 1), vs[0].transpose(0, 1)
            out[first:first + n] = self._prefill(qs, ks, vs, start)
        return self._out(out.view(T, self.h * self.hd), gate)

    def _out(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.o(o if gate is None else o * torch.sigmoid(gate))

    def _scores(self, s: torch.Tensor) -> torch.Tensor:
        """Scaled scores, soft-capped where the family caps them."""
        s = s.float() * self.scale
        return s if self.softcap is None else self.softcap * torch.tanh(s / self.softcap)

    def _prefill(self, q, k, v, start: int) -> torch.Tensor:
        """q: [n, H, hd]; k, v: [S, KVH, hd] with S = start + n. Mask from positions."""
        n, S = q.shape[0], k.shape[0]
        dt = q.dtype
        q, k, v = (t.transpose(0, 1).unsqueeze(0).to(dt) for t in (q, k, v))
        plain = self.softcap is None and self.sinks is None
        if start == 0 and self.window is None and plain:
            # plain causal, so fused kernels apply
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=True)
            return o[0].transpose(0, 1)
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        kpos = torch.arange(S, device=q.device)[None, :]
        mask = kpos <= qpos                                                      # [n, S]
        if self.window is not None:
            mask = mask & (kpos > qpos - self.window)
        if plain:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            return o[0].transpose(0, 1)
        g = self.h // self.kvh
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = self._scores(q @ k.transpose(-1, -2)).masked_fill(~mask, torch.finfo(torch.float32).min)
        if self.sinks is not None:           # [1, H, n, S] and each head's sink: dropped after the softmax
            sink = self.sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        return (p.to(dt) @ v)[0].transpose(0, 1)

    def _decode(self, q, kv_layer, meta: AttnMeta) -> torch.Tensor:
        """q: [B, H, hd], one query per sequence at the end of its context.

        Attends block by block on the gathered blocks ``[B, nb, KVH, BS, hd]`` without first
        making each sequence's K/V contiguous: that transpose-copy cost more than attention
        itself (2.7x slower per layer at batch 32, context 272 on CPU). The batch is cut into
        slices whose gathered K/V stay under ``DECODE_GATHER_BYTES``: padded to the longest
        context, 64 sequences of llama3-8b at 131,072 tokens would otherwise gather 34 GB."""
        tables, lens = meta.decode_tables, meta.decode_lens
        B, nb = tables.shape
        rows = decode_rows(B, nb * kv_layer.shape[-2], kv_layer.shape[2], self.hd, q.element_size())
        if rows >= B:
            return self._decode_rows(q, kv_layer, tables, lens)
        return torch.cat([self._decode_rows(q[i:i + rows], kv_layer, tables[i:i + rows], lens[i:i + rows])
                          for i in range(0, B, rows)])

    def _decode_rows(self, q, kv_layer, tables, lens) -> torch.Tensor:
        B, nb = tables.shape
        _, _, kvh, bs, _ = kv_layer.shape
        hd = self.hd
        # [2, B, nb, KVH, BS, hd], in the query's dtype whatever the pool stores (cache.dtype)
        kv = kv_format_of(kv_layer.dtype).decode(flat_gather(kv_layer, tables), q.dtype)
        qg = q.view(B, 1, kvh, self.h // kvh, hd)
        s = self._scores(qg @ kv[0].transpose(-1, -2))                  # [B, nb, KVH, g, BS]
        pos = torch.arange(nb * bs, device=q.device).view(1, nb, 1, 1, bs)
        hidden = pos >= lens.view(B, 1, 1, 1, 1)
        if self.window is not None:          # the query sits at lens - 1
            hidden = hidden | (pos <= lens.view(B, 1, 1, 1, 1) - 1 - self.window)
        s = s.masked_fill(hidden, torch.finfo(s.dtype).min)
        mx = s.amax(dim=(1, 4), keepdim=True)                            # [B, 1, KVH, g, 1]
        if self.sinks is not None:
            sink = self.sinks.float().view(1, 1, kvh, -1, 1)
            mx = torch.maximum(mx, sink)
        p = (s - mx).exp()
        den = p.sum(dim=(1, 4)).unsqueeze(-1)                            # [B, KVH, g, 1]
        if self.sinks is not None:
            den = den + (sink - mx)[:, 0].exp()
        o = (p.to(kv.dtype) @ kv[1]).sum(1).float() / den                # [B, KVH, g, hd]
        return o.to(q.dtype).reshape(B, self.h, hd)


DECODE_GATHER_BYTES = 256 << 20     # the most K/V one decode slice gathers


def decode_rows(batch: int, context: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Sequences a decode attends at once: all, unless their K/V padded to ``context`` would
    gather more than ``DECODE_GATHER_BYTES`` (then as many as fit, at least one)."""
    per_row = 2 * context * kv_heads * head_dim * itemsize
    return max(1, min(batch, DECODE_GATHER_BYTES // per_row))


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_layer: [2, NB, KVH, BS, row]; k, v: [T, KVH, hd]; slots: [T] (rows: ``kv_formats``)."""
    bs, fmt = kv_layer.shape[-2], kv_format_of(kv_layer.dtype)
    blocks, offs = slots // bs, slots % bs
    kv_layer[0, blocks, :, offs] = fmt.encode(k)
    kv_layer[1, blocks, :, offs] = fmt.encode(v)


def gather_kv(kv_layer: torch.Tensor, tables: torch.Tensor, length: int, dtype: torch.dtype):
    """The first ``length`` cached tokens of each table's sequence in ``dtype``:
    ([B, KVH, S, hd],) * 2."""
    B, nb = tables.shape
    _, _, kvh, bs, row = kv_layer.shape
    fmt = kv_format_of(kv_layer.dtype)
    hd = fmt.head_dim(row)
    kv = fmt.decode(flat_gather(kv_layer, tables), dtype)
    kv = kv.permute(0, 1, 3, 2, 4, 5).reshape(2, B, kvh, nb * bs, hd)[:, :, :, :length]
    return kv[0], kv[1]
