"""A block of the pool as bytes, every layer's K and V of it: what the host and disk tiers keep
of a block the pool evicts, and write back when a prefix hit finds it there."""

from __future__ import annotations

import torch


class PoolBlocks:
    def __init__(self, pool: torch.Tensor):
        """``pool``: ``[slots, 2, num_blocks, kv_heads, block_size, row]``, on any real device."""
        self.pool = pool
        self.shape = pool[:, :, 0].shape

    @property
    def block_bytes(self) -> int:
        return self.pool[:, :, 0].numel() * self.pool.element_size()

    def read(self, block: int) -> bytes:
        return bytes(self.pool[:, :, block].contiguous().cpu().view(torch.uint8).flatten().numpy())

    def write(self, block: int, payload: bytes) -> None:
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes here, got {len(payload)}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.pool[:, :, block].copy_(raw.view(self.pool.dtype).view(self.shape))
