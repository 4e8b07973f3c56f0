"""Paged attention as one static dataflow, for exported graphs (ONNX, MLIR, TensorRT).

The eager path loops over prefill chunks in Python; a graph cannot. Here a step's sequences form
two groups, each a dense tensor problem, while the projections still run once over all packed
tokens: *decodes* (one query each, attended block by block on one flat gather of their blocks,
no transpose: the layout that cost least over contiguous K/V in the prototype) and *chunks*
(padded to the longest chunk, cached blocks gathered and transposed once). A mixed step
is still one graph run. Either group may be empty, or absent (``None``: a graph traced for one
phase only, like the MLIR module's ``prefill`` and ``decode`` entry points).

A graph cannot update its pool input in place, so it attends to the cached tokens from the pool
plus the step's own new K/V, and returns the new K/V for the backend to write at their slots.
Masked scores take ``finfo.min`` (never ``-inf``: a fully masked padding row would be NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GraphMeta:
    """Inputs of the exported graph besides tokens, positions and the pool (int64 tensors)."""

    dec_index: torch.Tensor | None     # [D] token index of each one-token sequence
    # [L, D, Wd] each layer's K blocks (graph.inputs.layer_blocks; cached tokens only need to be covered)
    dec_blocks: torch.Tensor | None
    dec_cached: torch.Tensor | None    # [D] tokens cached before this step's token
    chunk_index: torch.Tensor | None   # [C, Q] token index of each padded query slot; padding = T
    chunk_blocks: torch.Tensor | None  # [L, C, Wc]
    chunk_cached: torch.Tensor | None  # [C] tokens cached before the chunk
    chunk_lens: torch.Tensor | None    # [C] real tokens in the chunk
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # each state layer's new state tensors ``[D, *shape]`` (a graph computes the decodes' one step)
    new_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    layer: int = 0               # the layer being traced (set by the model's layer loop)
    # masks every layer shares, built once per step (traced once, not once a layer)
    memo: dict[str, torch.Tensor] = field(default_factory=dict)

    def shared(self, key: str, build) -> torch.Tensor:
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]


def flat_gather(kv_layer: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[2, B, nb, KVH, BS, hd]``: one gather over the layer's ``2 * NB`` blocks."""
    nb_total = kv_layer.shape[1]
    flat = tables.reshape(-1)
    rest = kv_layer.shape[2:]
    out = kv_layer.reshape(2 * nb_total, *rest).index_select(0, torch.cat([flat, flat + nb_total]))
    return out.reshape(2, tables.shape[0], tables.shape[1], *rest)


def pool_gather(pool: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V blocks ``[B, nb, KVH, BS, hd]`` at a layer's K block indices ``blocks [B, nb]``,
    indexing the whole pool ``[S, 2, NB, ...]`` as one flat array of blocks (V is ``NB``
    further). In a graph, selecting the layer's slab first becomes a Gather that copies all of
    it, and gathering K and V together then splitting them copies the gathered blocks a second
    time: two gathers copy each byte once."""
    nb_total = pool.shape[2]
    flat = blocks.reshape(-1)
    shape = (*blocks.shape, *pool.shape[3:])
    every = pool.reshape(-1, *pool.shape[3:])
    return (every.index_select(0, flat).reshape(shape),
            every.index_select(0, flat + nb_total).reshape(shape))


@dataclass(frozen=True)
class Scores:
    """How a layer turns q·k into scores: the scale, a soft-cap, a sliding window (None: none)."""

    scale: float
    softcap: float | None = None
    window: int | None = None

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        s = s.float() * self.scale
        return s if self.softcap is None else self.softcap * torch.tanh(s / self.softcap)


def graph_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                    m: GraphMeta, scale: Scores, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, hd]; k, v: [T, KVH, hd]; pool: [S, 2, NB, KVH, BS, hd] → [T, H, hd]; ``sinks
    [H]``: each head's logit in every softmax's denominator (gpt-oss), or None."""
    T, H, hd = q.shape
    kvh = pool.shape[3]
    # one zero row at index T: where chunk padding slots read from and write to
    q1 = torch.cat([q, q.new_zeros(1, H, hd)])
    k1 = torch.cat([k, k.new_zeros(1, kvh, hd)])
    v1 = torch.cat([v, v.new_zeros(1, kvh, hd)])
    out = q.new_zeros(T + 1, H, hd)
    if m.dec_index is not None:
        out = out.index_copy(0, m.dec_index, _decodes(q1, k1, v1, pool, m, scale, sinks))
    if m.chunk_index is not None:
        out = out.index_copy(0, m.chunk_index.reshape(-1), _chunks(q1, k1, v1, pool, m, scale, sinks))
    return out[:T]


def _decodes(q1, k1, v1, pool, m: GraphMeta, scale: Scores, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence: cached blocks, block by block, plus the token's own new key."""
    H, hd = q1.shape[1:]
    kvh, bs = pool.shape[3], pool.shape[4]
    g = H // kvh
    minf = torch.finfo(torch.float32).min
    D, Wd = m.dec_blocks.shape[1:]
    qd = q1.index_select(0, m.dec_index).reshape(D, 1, kvh, g, hd)
    kd, vd = (t.to(q1.dtype) for t in pool_gather(pool, m.dec_blocks[m.layer]))  # [D, Wd, KVH, BS, hd]
    s = scale(qd @ kd.transpose(-1, -2))                                # [D, Wd, KVH, g, BS]
    invalid = m.shared(f"dec_invalid_{scale.window}", lambda: dec_invalid(m, Wd, bs, scale.window, q1.device))
    s = s.masked_fill(invalid, minf)
    k_self = k1.index_select(0, m.dec_index).reshape(D, kvh, 1, hd)
    v_self = v1.index_select(0, m.dec_index).reshape(D, kvh, 1, hd)
    s_self = scale((qd.reshape(D, kvh, g, hd) * k_self).float().sum(-1))     # [D, KVH, g]
    mx = torch.maximum(s.amax(dim=(1, 4)), s_self)
    if sinks is not None:
        sink = sinks.float().reshape(1, kvh, g)
        mx = torch.maximum(mx, sink)
    p = (s - mx.reshape(D, 1, kvh, g, 1)).exp()
    p_self = (s_self - mx).exp()
    den = p.sum(dim=(1, 4)) + p_self
    if sinks is not None:
        den = den + (sink - mx).exp()
    o = (p.to(q1.dtype) @ vd).sum(1).float() + p_self.unsqueeze(-1) * v_self.float()
    return (o / den.unsqueeze(-1)).to(q1.dtype).reshape(D, H, hd)


def dec_invalid(m: GraphMeta, Wd: int, bs: int, window: int | None, device) -> torch.Tensor:
    """``[D, Wd, 1, 1, BS]``: cached keys a decode does not see: past its cache, or (sliding)
    not after ``position - window``, its position being the count of cached tokens."""
    D = m.dec_cached.shape[0]
    j = torch.arange(Wd * bs, device=device).reshape(1, Wd, 1, 1, bs)
    cached = m.dec_cached.reshape(D, 1, 1, 1, 1)
    out = j >= cached
    if window is not None:
        out = torch.logical_or(out, j <= cached - window)
    return out


def _chunks(q1, k1, v1, pool, m: GraphMeta, scale: Scores, sinks: torch.Tensor | None) -> torch.Tensor:
    """Padded queries over [cached tokens from the pool | the chunk's own new keys]."""
    H, hd = q1.shape[1:]
    kvh, bs = pool.shape[3], pool.shape[4]
    g = H // kvh
    minf = torch.finfo(torch.float32).min
    C, Q = m.chunk_index.shape
    Wc = m.chunk_blocks.shape[2]
    idx = m.chunk_index.reshape(-1)
    qc = q1.index_select(0, idx).reshape(C, Q, kvh, g, hd).permute(0, 2, 3, 1, 4)  # [C,KVH,g,Q,hd]
    kc, vc = (t.to(q1.dtype).transpose(1, 2).reshape(C, kvh, Wc * bs, hd)
              for t in pool_gather(pool, m.chunk_blocks[m.layer]))
    kn = k1.index_select(0, idx).reshape(C, Q, kvh, hd).transpose(1, 2)
    vn = v1.index_select(0, idx).reshape(C, Q, kvh, hd).transpose(1, 2)
    keys = torch.cat([kc, kn], dim=2).unsqueeze(2)                     # [C, KVH, 1, S+Q, hd]
    vals = torch.cat([vc, vn], dim=2).unsqueeze(2)
    s = scale(qc @ keys.transpose(-1, -2))                                # [C, KVH, g, Q, S+Q]
    hidden = m.shared(f"chunk_hidden_{scale.window}",
                      lambda: ~chunk_visible(m, Wc * bs, Q, q1.device, scale.window))
    s = s.masked_fill(hidden, minf)
    if sinks is not None:                 # a column of each head's sink, dropped after the softmax
        sink = sinks.float().reshape(1, kvh, g, 1, 1).expand(C, kvh, g, Q, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1].to(q1.dtype)
    else:
        p = torch.softmax(s, dim=-1).to(q1.dtype)
    return (p @ vals).permute(0, 3, 1, 2, 4).reshape(C * Q, H, hd)


def chunk_visible(m: GraphMeta, cached_width: int, Q: int, device, window: int | None = None) -> torch.Tensor:
    """``[C, 1, 1, Q, S+Q]``: query i of a chunk sees the cached tokens and its chunk's new
    tokens up to itself (padding queries see only cached ones; their rows are dropped); in a
    sliding layer only keys after ``position - window``."""
    C = m.chunk_index.shape[0]
    j = torch.arange(cached_width + Q, device=device)
    i = torch.arange(Q, device=device)
    cached = j.reshape(1, 1, -1) < m.chunk_cached.reshape(C, 1, 1)          # [C, 1, S+Q]
    jn = (j - cached_width).reshape(1, 1, -1)                               # index among new keys
    # logical_and/or, not & and |: IREE does not compile broadcast & on booleans
    new = torch.logical_and(torch.logical_and(jn >= 0, jn <= i.reshape(1, Q, 1)),
                            jn < m.chunk_lens.reshape(C, 1, 1))
    if window is not None:       # query i sits at chunk_cached + i; a cached key j at j
        pos = m.chunk_cached.reshape(C, 1, 1) + i.reshape(1, Q, 1)
        cached = torch.logical_and(cached, j.reshape(1, 1, -1) > pos - window)
        new = torch.logical_and(new, jn > i.reshape(1, Q, 1) - window)
    return torch.logical_or(cached, new).reshape(C, 1, 1, Q, cached_width + Q)
