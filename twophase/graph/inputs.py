"""A batch turned into a graph's inputs, and a graph's new K/V written into the pool: the
runtime side every graph backend shares (a graph cannot update its pool input in place, so it
returns the step's K/V and the backend writes them at the batch's slots).

Graphs never see the pool's layout (``KVGroups``): they take each layer's blocks as indices of
the pool viewed as one flat array of ``S * P * NB`` blocks (``layer_blocks``; ``P`` planes: K
and V, or one latent), so one graph
reads a plain pool (a slot a layer) and a pool in groups (sliding layers holding only their
window) alike, and the backend writes the new K/V at rows computed the same way (``kv_rows``).
"""

from __future__ import annotations

import torch

from twophase.contract import DecodeBatch, KVCache, KVGroups, PrefillBatch


def _layout(pool_shape: tuple[int, ...], groups: KVGroups | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's group and pool slot (``[L]`` each); no groups: slot ``i`` is layer ``i``."""
    g = groups if groups is not None else KVGroups.plain(pool_shape[0])
    return torch.tensor(g.group, dtype=torch.long), torch.tensor(g.slot, dtype=torch.long)


def _per_group(t: torch.Tensor, dims: int) -> torch.Tensor:
    """``t`` with its group dimension first (a plain layout's tables have none)."""
    return t if t.dim() == dims + 1 else t.unsqueeze(0)


def layer_blocks(tables: torch.Tensor, pool_shape: tuple[int, ...],
                 groups: KVGroups | None) -> torch.Tensor:
    """``[L, B, W]``: the index of each layer's K block among the pool's ``S * P * NB`` blocks
    (its V block, if the pool has that plane, is ``NB`` further), for ``tables [B, W]`` or ``[G,
    B, W]`` (one a group)."""
    group, slot = _layout(pool_shape, groups)
    planes, nb = pool_shape[1], pool_shape[2]
    return _per_group(tables, 2)[group] + (planes * nb * slot).view(-1, 1, 1)


def kv_rows(pool_shape: tuple[int, ...], slots: torch.Tensor, groups: KVGroups | None) -> torch.Tensor:
    """``[L, P, T, KVH]``: the row of the pool viewed as ``[-1, hd]`` where each layer's K and V
    (``P = 2``) or latent (``P = 1``) of each token go, for ``slots [T]`` or ``[G, T]``."""
    _, planes, nb, kvh, bs, _ = pool_shape
    group, slot = _layout(pool_shape, groups)
    s = _per_group(slots.cpu(), 1)[group]                                   # [L, T]
    block = (planes * slot.view(-1, 1) * nb + s // bs).unsqueeze(1) + (torch.arange(planes) * nb).view(1, -1, 1)
    heads = torch.arange(kvh).view(1, 1, 1, kvh)
    return ((block.unsqueeze(-1) * kvh + heads) * bs + (s % bs).view(s.shape[0], 1, -1, 1))


def step_inputs(batch: PrefillBatch, kv: KVCache, decodes: bool = True) -> dict[str, torch.Tensor]:
    """The step graph's inputs for ``batch`` (CPU int64), ``kv_pool`` aside. Sequences with one
    new token go to the decode group (unless ``decodes`` is false), the others to the (padded)
    chunk group."""
    T, block_size = batch.num_tokens, kv.block_size
    L = len(kv.groups.group) if kv.groups is not None else kv.pool.shape[0]
    starts, lens, first = batch.start_positions, batch.query_lens, batch.query_start
    dec = [i for i, n in enumerate(lens) if n == 1 and decodes]
    chk = [i for i, n in enumerate(lens) if not (n == 1 and decodes)]
    tables_g = _per_group(batch.block_tables, 2)

    def tables(rows: list[int], cached: list[int]) -> torch.Tensor:
        width = max([-(-c // block_size) for c in cached] + [1])
        if not rows:
            return torch.zeros(L, 0, 1, dtype=torch.long)
        return layer_blocks(tables_g[:, rows, :width], tuple(kv.pool.shape), kv.groups)

    q = max([lens[i] for i in chk] + [1])
    chunk_index = torch.full((len(chk), q), T, dtype=torch.long)
    for r, i in enumerate(chk):
        chunk_index[r, :lens[i]] = torch.arange(first[i], first[i] + lens[i])
    if batch.logits == "last":
        logits_index = torch.tensor([first[i + 1] - 1 for i in range(batch.num_seqs)], dtype=torch.long)
    else:
        logits_index = torch.arange(T)

    def long(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long)

    return {
        "input_ids": batch.token_ids, "positions": batch.positions,
        "dec_index": long([first[i] for i in dec]),
        "dec_blocks": tables(dec, [starts[i] for i in dec]),
        "dec_cached": long([starts[i] for i in dec]),
        "chunk_index": chunk_index,
        "chunk_blocks": tables(chk, [starts[i] for i in chk]),
        "chunk_cached": long([starts[i] for i in chk]),
        "chunk_lens": long([lens[i] for i in chk]),
        "logits_index": logits_index,
    }


def decode_graph_inputs(batch: DecodeBatch, pool: torch.Tensor,
                        groups: KVGroups | None = None) -> dict[str, torch.Tensor]:
    """The decode-only graph's inputs: each layer's K then V block ids of every sequence's cached
    tokens, as indices of the pool's ``L * 2 * NB`` blocks (``[2L, B, W]``), and a mask of the
    padding past each sequence's own cache (``[B, 1, 1, W * BS + 1]``; the last column is the
    new token)."""
    BS = pool.shape[4]
    B, cached = batch.token_ids.shape[0], batch.context_lens - 1
    W = max(1, -(-int(cached.max()) // BS))
    blocks = _kv_blocks(batch.block_tables, W, pool, groups)
    mask = torch.zeros(B, 1, 1, W * BS + 1)
    mask[:, 0, 0, :-1] = torch.where(torch.arange(W * BS).view(1, -1) < cached.view(B, 1), 0.0, float("-inf"))
    return {"input_ids": batch.token_ids, "positions": batch.positions.view(-1, 1),
            "blocks": blocks, "mask": mask}


def _kv_blocks(block_tables: torch.Tensor, W: int, pool: torch.Tensor,
               groups: KVGroups | None) -> torch.Tensor:
    """``[2L, B, W]``: each layer's K then V blocks of the first ``W`` of each table."""
    if block_tables.shape[-1] < W:
        raise ValueError(f"block tables of width {block_tables.shape[-1]} for {W} cached blocks")
    k = layer_blocks(block_tables[..., :W], tuple(pool.shape), groups)
    return torch.stack([k, k + pool.shape[2]], dim=1).reshape(-1, *k.shape[1:])


def verify_graph_inputs(batch: PrefillBatch, pool: torch.Tensor, group: int,
                        groups: KVGroups | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The verify graph's inputs for a batch of short chunks, and which of its ``B * Q`` rows
    are the batch's tokens (the rest is padding, up to the longest chunk ``Q``). ``group``:
    query heads a KV head. Each sequence's row ``q * group + g`` of ``mask`` opens its cached
    tokens and its own new tokens up to ``q``; a padding row (its outputs dropped) sees the same
    up to itself, so no row is all ``-inf``."""
    BS = pool.shape[4]
    lens, starts, B = batch.query_lens, batch.start_positions, batch.num_seqs
    Q = max(lens)
    cached = torch.tensor(starts, dtype=torch.long)
    W = max(1, -(-int(cached.max()) // BS))
    rows = torch.cat([torch.arange(n) + b * Q for b, n in enumerate(lens)])
    ids = torch.zeros(B * Q, dtype=torch.long)
    ids[rows] = batch.token_ids
    q = torch.arange(Q)
    positions = cached.view(B, 1) + q.view(1, Q)
    positions = torch.minimum(positions, positions.new_tensor(lens).view(B, 1) + cached.view(B, 1) - 1)
    blocks = _kv_blocks(batch.block_tables, W, pool, groups)
    past = torch.arange(W * BS).view(1, 1, -1) < cached.view(B, 1, 1)               # [B, 1, W*BS]
    own = q.view(1, 1, Q) <= q.view(1, Q, 1)                                       # [1, Q, Q]
    allowed = torch.cat([past.expand(B, Q, W * BS), own.expand(B, Q, Q)], dim=2)     # [B, Q, PQ]
    mask = torch.zeros(B, Q, W * BS + Q).masked_fill_(~allowed, float("-inf"))
    mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)                         # [B, 1, QG, PQ]
    return {"input_ids": ids, "positions": positions, "blocks": blocks, "mask": mask}, rows


def write_new_kv(pool: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                 slots: torch.Tensor, groups: KVGroups | None = None) -> None:
    """Write a graph's ``new_k``/``new_v [L, T, KVH, hd]`` into ``pool`` at ``slots`` (``[T]``,
    or ``[G, T]`` in ``groups``), as one ``index_copy_`` over the pool viewed as rows of ``hd``
    values: two advanced-index writes a layer cost far more a decode step (docs/measurements.md,
    "Figures behind choices in the code")."""
    write_rows(pool, new_k, new_v, kv_rows(tuple(pool.shape), slots, groups).to(pool.device))


def write_rows(pool: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, rows: torch.Tensor) -> None:
    """The write at ``rows`` (``kv_rows``'s ``[L, P, T, KVH]``): also an MLIR entry point. A
    latent pool (one plane) takes ``new_k``; its graph returns the latents as ``new_v`` too."""
    hd = pool.shape[-1]
    src = (torch.stack([new_k, new_v], dim=1) if rows.shape[1] == 2 else new_k).reshape(-1, hd)  # [L, P, T, KVH, hd]
    pool.view(-1, hd).index_copy_(0, rows.reshape(-1), src.to(pool.dtype))


def state_inputs(kv: KVCache, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """A graph's state inputs (``signature.with_states``): each state layer's tensors at the
    decodes' ``slots [D]``, ``state_J_I [D, *shape]``."""
    return {f"state_{j}_{i}": t.index_select(0, slots) for j, layer in enumerate(kv.states)
            for i, t in enumerate(layer)}


def write_states(kv: KVCache, new: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
    """Write a graph's new states ``new_state_J_I [D, *shape]`` back at the decodes' ``slots``."""
    for j, layer in enumerate(kv.states):
        for i, t in enumerate(layer):
            t.index_copy_(0, slots, new[f"new_state_{j}_{i}"].to(t.dtype))
