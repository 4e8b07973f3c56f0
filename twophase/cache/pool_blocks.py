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


class StateRows:
    """A row of the state layers' tensors as bytes (every layer's convolution tail and recurrent
    state of one saved sequence): what the tiers keep of a prefix snapshot."""

    def __init__(self, states: tuple[tuple[torch.Tensor, ...], ...]):
        self.tensors = [t for layer in states for t in layer]

    @property
    def row_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def read(self, row: int) -> bytes:
        return b"".join(bytes(t[row].contiguous().cpu().view(torch.uint8).flatten().numpy())
                        for t in self.tensors)

    def write(self, row: int, payload: bytes) -> None:
        if len(payload) != self.row_bytes:
            raise ValueError(f"a state row is {self.row_bytes} bytes here, got {len(payload)}")
        raw, at = torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0
        for t in self.tensors:
            n = t[0].numel() * t.element_size()
            t[row].copy_(raw[at:at + n].view(t.dtype).view(t[0].shape))
            at += n
