"""A batch turned into a graph's inputs, and a graph's new K/V written into the pool: the
runtime side every graph backend shares (a graph cannot update its pool input in place, so it
returns the step's K/V and the backend writes them at the batch's slots)."""

from __future__ import annotations

import torch

from twophase.contract import DecodeBatch, PrefillBatch


def step_inputs(batch: PrefillBatch, block_size: int, decodes: bool = True) -> dict[str, torch.Tensor]:
    """The step graph's inputs for ``batch`` (CPU int64), ``kv_pool`` aside. Sequences with one
    new token go to the decode group (unless ``decodes`` is false), the others to the (padded)
    chunk group."""
    T = batch.num_tokens
    starts, lens, first = batch.start_positions, batch.query_lens, batch.query_start
    dec = [i for i, n in enumerate(lens) if n == 1 and decodes]
    chk = [i for i, n in enumerate(lens) if not (n == 1 and decodes)]

    def tables(rows: list[int], cached: list[int]) -> torch.Tensor:
        width = max([-(-c // block_size) for c in cached] + [1])
        return batch.block_tables[rows, :width] if rows else torch.zeros(0, 1, dtype=torch.long)

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
        "dec_tables": tables(dec, [starts[i] for i in dec]),
        "dec_cached": long([starts[i] for i in dec]),
        "chunk_index": chunk_index,
        "chunk_tables": tables(chk, [starts[i] for i in chk]),
        "chunk_cached": long([starts[i] for i in chk]),
        "chunk_lens": long([lens[i] for i in chk]),
        "logits_index": logits_index,
    }


def decode_graph_inputs(batch: DecodeBatch, pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """The decode-only graph's inputs: each layer's K then V block ids of every sequence's cached
    tokens, as indices of the pool's ``L * 2 * NB`` blocks (``[2L, B, W]``), and a mask of the
    padding past each sequence's own cache (``[B, 1, 1, W * BS + 1]``; the last column is the
    new token)."""
    L, _, NB, _, BS, _ = pool.shape
    B, cached = batch.token_ids.shape[0], batch.context_lens - 1
    W = max(1, -(-int(cached.max()) // BS))
    if batch.block_tables.shape[1] < W:
        raise ValueError(f"block tables of width {batch.block_tables.shape[1]} for {W} cached blocks")
    blocks = torch.arange(2 * L).view(2 * L, 1, 1) * NB + batch.block_tables[:, :W].view(1, B, W)
    mask = torch.zeros(B, 1, 1, W * BS + 1)
    mask[:, 0, 0, :-1] = torch.where(torch.arange(W * BS).view(1, -1) < cached.view(B, 1), 0.0, float("-inf"))
    return {"input_ids": batch.token_ids, "positions": batch.positions.view(-1, 1),
            "blocks": blocks, "mask": mask}


def verify_graph_inputs(batch: PrefillBatch, pool: torch.Tensor,
                        group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The verify graph's inputs for a batch of short chunks, and which of its ``B * Q`` rows
    are the batch's tokens (the rest is padding, up to the longest chunk ``Q``). ``group``:
    query heads a KV head. Each sequence's row ``q * group + g`` of ``mask`` opens its cached
    tokens and its own new tokens up to ``q``; a padding row (its outputs dropped) sees the same
    up to itself, so no row is all ``-inf``."""
    L, _, NB, _, BS, _ = pool.shape
    lens, starts, B = batch.query_lens, batch.start_positions, batch.num_seqs
    Q = max(lens)
    cached = torch.tensor(starts, dtype=torch.long)
    W = max(1, -(-int(cached.max()) // BS))
    if batch.block_tables.shape[1] < W:
        raise ValueError(f"block tables of width {batch.block_tables.shape[1]} for {W} cached blocks")
    rows = torch.cat([torch.arange(n) + b * Q for b, n in enumerate(lens)])
    ids = torch.zeros(B * Q, dtype=torch.long)
    ids[rows] = batch.token_ids
    q = torch.arange(Q)
    positions = cached.view(B, 1) + q.view(1, Q)
    positions = torch.minimum(positions, positions.new_tensor(lens).view(B, 1) + cached.view(B, 1) - 1)
    blocks = torch.arange(2 * L).view(2 * L, 1, 1) * NB + batch.block_tables[:, :W].view(1, B, W)
    past = torch.arange(W * BS).view(1, 1, -1) < cached.view(B, 1, 1)               # [B, 1, W*BS]
    own = q.view(1, 1, Q) <= q.view(1, Q, 1)                                       # [1, Q, Q]
    allowed = torch.cat([past.expand(B, Q, W * BS), own.expand(B, Q, Q)], dim=2)     # [B, Q, PQ]
    mask = torch.zeros(B, Q, W * BS + Q).masked_fill_(~allowed, float("-inf"))
    mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)                         # [B, 1, QG, PQ]
    return {"input_ids": ids, "positions": positions, "blocks": blocks, "mask": mask}, rows


def write_new_kv(pool: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write a graph's ``new_k``/``new_v [L, T, KVH, hd]`` into ``pool`` at ``slots [T]``, as
    one ``index_copy_`` over the pool viewed as rows of ``hd`` values (60 advanced-index
    writes, two a layer, took 15 ms a decode step for the default model)."""
    L, _, NB, KVH, BS, hd = pool.shape
    T = slots.shape[0]
    slots = slots.to(pool.device)
    layer_kv = torch.arange(2 * L, device=pool.device).view(2 * L, 1, 1)
    heads = torch.arange(KVH, device=pool.device).view(1, 1, KVH)
    blocks, offs = (slots // BS).view(1, T, 1), (slots % BS).view(1, T, 1)
    rows = ((layer_kv * NB + blocks) * KVH + heads) * BS + offs              # [2L, T, KVH]
    src = torch.stack([new_k, new_v], dim=1).reshape(2 * L * T * KVH, hd)   # [L, 2, T, KVH, hd]
    pool.view(-1, hd).index_copy_(0, rows.reshape(-1), src.to(pool.dtype))
