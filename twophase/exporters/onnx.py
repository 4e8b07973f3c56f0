"""torch → ONNX: the project's own Llama, traced with its static-dataflow paged attention.

One graph serves both phases and any mix: a batch of one-token decodes, prefill chunks after
cached tokens, or both at once (``twophase.models.graph_attention``). Every dimension is dynamic
(tokens, sequences, chunk length, block-table widths, pool size), so one export serves any
batch and any pool. The dynamo exporter is used: the TorchScript one hard-coded the block-table
width and failed at run time.

Inputs: ``input_ids [T]``, ``positions [T]``, ``kv_pool [L, 2, NB, KVH, BS, hd]``, the seven
``GraphMeta`` tensors, ``logits_index [N]`` (rows of the packed tokens whose logits are wanted:
each sequence's last token, or all). Outputs: ``logits [N, vocab]`` float32, ``new_k`` and
``new_v [L, T, KVH, hd]`` for the backend to write into the pool at the batch's slots.
"""

from __future__ import annotations

import torch
from torch import nn

from twophase.backends.base import PrefillBatch
from twophase.models.graph_attention import GraphMeta
from twophase.models.llama import Llama

INPUTS = ["input_ids", "positions", "kv_pool", "dec_index", "dec_tables", "dec_cached",
          "chunk_index", "chunk_tables", "chunk_cached", "chunk_lens", "logits_index"]
OUTPUTS = ["logits", "new_k", "new_v"]


class PagedStep(nn.Module):
    """The function every graph backend runs: one step over packed tokens."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, kv_pool, dec_index, dec_tables, dec_cached,
                chunk_index, chunk_tables, chunk_cached, chunk_lens, logits_index):
        meta = GraphMeta(dec_index, dec_tables, dec_cached, chunk_index, chunk_tables,
                         chunk_cached, chunk_lens)
        hidden = self.model(input_ids, positions, kv_pool, meta)
        logits = self.model.logits(hidden.index_select(0, logits_index))
        new_k = torch.stack([k for k, _ in meta.new_kv])
        new_v = torch.stack([v for _, v in meta.new_kv])
        return logits, new_k, new_v


def graph_inputs(batch: PrefillBatch, block_size: int) -> dict[str, torch.Tensor]:
    """The graph's inputs for ``batch`` (CPU int64), ``kv_pool`` aside. Sequences with one new
    token go to the decode group, the others to the (padded) chunk group."""
    T = batch.num_tokens
    starts, lens, first = batch.start_positions, batch.query_lens, batch.query_start
    dec = [i for i, n in enumerate(lens) if n == 1]
    chk = [i for i, n in enumerate(lens) if n > 1]

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
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
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


def run_eager(step: PagedStep, pool: torch.Tensor, inputs: dict[str, torch.Tensor]):
    """The graph's function run by torch itself (the reference an export must match)."""
    with torch.inference_mode():
        return step(*(pool if n == "kv_pool" else inputs[n] for n in INPUTS))


def write_new_kv(pool: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write a graph's ``new_k``/``new_v [L, T, KVH, hd]`` into ``pool`` at ``slots [T]``."""
    bs = pool.shape[4]
    blocks, offs = slots // bs, slots % bs
    for layer in range(pool.shape[0]):
        pool[layer, 0, blocks, :, offs] = new_k[layer].to(pool.dtype)
        pool[layer, 1, blocks, :, offs] = new_v[layer].to(pool.dtype)
