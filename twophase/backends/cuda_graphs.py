"""CUDA graphs for the pure-decode step, one per (batch-size, context-blocks) bucket.

Buckets are powers of two, captured lazily on first use. Padding rows write their K/V into the
pool's scratch block (which core never hands out) and attend to one token, so they neither
touch real sequences nor produce NaNs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from twophase.contract import DecodeBatch, KVCache


def bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(self, forward: Callable[..., torch.Tensor], kv: KVCache):
        self.forward = forward
        self.device = kv.pool.device
        self.scratch_slot = (kv.num_blocks - 1) * kv.block_size
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        B, nb = batch.num_seqs, batch.block_tables.shape[1]
        key = (bucket(B), bucket(nb))
        c = self.captured.get(key) or self._capture(*key)
        c.tokens[:B].copy_(batch.token_ids)
        c.positions[:B].copy_(batch.positions)
        c.slots[:B].copy_(batch.slot_mapping)
        c.lens[:B].copy_(batch.context_lens)
        c.tables.zero_()
        c.tables[:B, :nb].copy_(batch.block_tables)
        if B < key[0]:                       # padding rows: scratch slot, one-token context
            c.tokens[B:].zero_()
            c.positions[B:].zero_()
            c.slots[B:].fill_(self.scratch_slot)
            c.lens[B:].fill_(1)
        c.graph.replay()
        return c.logits[:B].clone()

    def _capture(self, bsz: int, nblocks: int) -> _Captured:
        with torch.cuda.device(self.device):
            return self._capture_on_device(bsz, nblocks)

    def _capture_on_device(self, bsz: int, nblocks: int) -> _Captured:
        dev = self.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        tokens, positions, tables = z(bsz), z(bsz), z(bsz, nblocks)
        slots = torch.full((bsz,), self.scratch_slot, dtype=torch.long, device=dev)
        lens = torch.ones(bsz, dtype=torch.long, device=dev)
        args = (tokens, positions, slots, tables, lens)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                # warm-up outside the graph (allocator, kernels)
                self.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self.forward(*args)
        c = _Captured(graph, tokens, positions, slots, tables, lens, logits)
        self.captured[(bsz, nblocks)] = c
        return c
