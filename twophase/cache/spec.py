"""What one layer's cache holds, as a typed spec: its bytes, how it is freed, what a prefix hit
must restore and what a rejected draft rolls back.

A layer group of the pool has one spec; the pool layout (``twophase.cache.layout``) sizes the pool
from the specs alone, and the KV manager frees each group's blocks as its spec says. A new kind of
cache (a fixed-size state a sequence, a latent a token shared by every head) is a new spec class
here, answering the same questions, not a branch in the planner or the engine.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from twophase.kv_formats import kv_format


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheSpec(ABC):
    """One layer's cache. Token caches (K/V, a latent) grow a block at a time; a state cache
    would hold a fixed number of bytes a sequence instead."""

    kind: ClassVar[str]
    freed: ClassVar[str]              # when its memory goes back, in words
    prefix_hit: ClassVar[str]         # what a prefix-cache hit must restore
    rollback: ClassVar[str]           # what a rejected draft takes back
    travels: ClassVar[str]            # what moves with a request to another worker

    @property
    def window(self) -> int | None:
        """Tokens before the query it reads (None: every one): a group's blocks past it are freed."""
        return None

    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes one token adds (0 for a cache of fixed size)."""

    def bytes_per_sequence(self) -> int:
        """Bytes a sequence holds whatever its length (a state; 0 for token caches)."""
        return 0

    def page_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` tokens takes for this layer."""
        return self.bytes_per_token() * block_size

    def live_blocks(self, tokens: int, chunk: int, block_size: int) -> int:
        """The most blocks one sequence of ``tokens`` holds at once, computed ``chunk`` at a time."""
        return cdiv(tokens, block_size)

    def step_blocks(self, chunk: int, block_size: int) -> int:
        """Blocks held beyond a sequence's own while a step computes ``chunk`` tokens."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(CacheSpec):
    """K and V of every head, every token, kept for the whole request."""

    num_kv_heads: int
    head_dim: int
    format: str                       # the K/V format's name (``twophase.kv_formats``)

    kind: ClassVar[str] = "full attention"
    planes: ClassVar[int] = 2         # K and V (the pool's second axis)
    freed: ClassVar[str] = "at the end of the request"
    prefix_hit: ClassVar[str] = "the prefix's blocks"
    rollback: ClassVar[str] = "the blocks wholly past the kept tokens"
    travels: ClassVar[str] = "its blocks, in the block table's order"

    def row_bytes(self) -> int:
        """Bytes of one head's vector as the pool stores it (an int8 row carries its scales)."""
        fmt = kv_format(self.format)
        return fmt.row(self.head_dim) * torch.empty((), dtype=fmt.storage).element_size()

    def bytes_per_token(self) -> int:
        return self.planes * self.num_kv_heads * self.row_bytes()


@dataclass(frozen=True)
class LatentSpec(FullAttentionSpec):
    """Multi-head latent attention's cache: one latent a token a layer (``head_dim`` values: the
    compressed keys and values and the shared rotary key), read by every head; no heads, no
    second plane. Kept, freed, restored and moved as full attention's blocks are."""

    kind: ClassVar[str] = "latent"
    planes: ClassVar[int] = 1


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V of the last ``sliding_window`` tokens: blocks wholly before the window of the next
    query go back to the pool."""

    sliding_window: int = 0

    kind: ClassVar[str] = "sliding window"
    freed: ClassVar[str] = "as they fall out of the window"
    prefix_hit: ClassVar[str] = "the blocks of the prefix's last window"

    @property
    def window(self) -> int | None:
        return self.sliding_window

    def live_blocks(self, tokens: int, chunk: int, block_size: int) -> int:
        """The window's blocks and a chunk's, at most every block."""
        return min(cdiv(tokens, block_size),
                   cdiv(self.sliding_window - 1 + min(chunk, tokens), block_size) + 1)

    def step_blocks(self, chunk: int, block_size: int) -> int:
        return cdiv(chunk, block_size)


@dataclass(frozen=True)
class StateSpec(CacheSpec):
    """The state layers' cache (a Gated DeltaNet's convolution tail and delta-rule matrices):
    a fixed number of bytes a sequence whatever its length, in one slot a running sequence
    holds beside its block tables. It takes no blocks."""

    num_layers: int
    shapes: tuple[tuple[int, ...], ...]    # one sequence's tensors in one layer
    dtype: str = "float32"

    kind: ClassVar[str] = "state"
    freed: ClassVar[str] = "at the end of the request (its slot)"
    prefix_hit: ClassVar[str] = "the state at the end of the prefix"
    rollback: ClassVar[str] = "the state before the rejected drafts"
    travels: ClassVar[str] = "its slot's tensors"

    def bytes_per_token(self) -> int:
        return 0

    def bytes_per_sequence(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * itemsize * sum(math.prod(s) for s in self.shapes)

    def live_blocks(self, tokens: int, chunk: int, block_size: int) -> int:
        return 0


def attention_spec(window: int | None, num_kv_heads: int, head_dim: int, format: str,
                   planes: int = 2) -> FullAttentionSpec:
    """The spec of an attention layer with ``window`` (None: full); one plane: a latent."""
    if planes == 1:
        if window is not None:
            raise ValueError("a latent cache with a sliding window is not implemented")
        return LatentSpec(num_kv_heads, head_dim, format)
    if window is None:
        return FullAttentionSpec(num_kv_heads, head_dim, format)
    return SlidingWindowSpec(num_kv_heads, head_dim, format, window)


def sequence_blocks(specs: Sequence[CacheSpec], tokens: int, chunk: int, block_size: int) -> int:
    """Blocks of the pool one sequence of ``tokens`` needs at its peak, a spec a group."""
    return sum(s.live_blocks(tokens, chunk, block_size) for s in specs)


def step_blocks(specs: Sequence[CacheSpec], chunk: int, block_size: int) -> int:
    """Blocks the groups hold beyond their sequences' while a step computes ``chunk`` tokens
    (a budget's worth a step, shared by the sequences prefilling in it)."""
    return sum(s.step_blocks(chunk, block_size) for s in specs)


def context_tokens(specs: Sequence[CacheSpec], num_blocks: int, chunk: int, block_size: int) -> int:
    """The longest sequence ``num_blocks`` hold (``sequence_blocks``' inverse); where every group
    slides, any whose windows and chunk fit."""
    if all(s.window is not None for s in specs) and sequence_blocks(specs, 1 << 62, chunk, block_size) <= num_blocks:
        return 1 << 62
    lo, hi = 0, num_blocks * block_size                # sequence_blocks grows with the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sequence_blocks(specs, mid, chunk, block_size) <= num_blocks else (lo, mid - 1)
    return lo


def concurrency(specs: Sequence[CacheSpec], num_blocks: int, context: int, chunk: int, block_size: int) -> int:
    """Sequences of ``context`` tokens ``num_blocks`` hold at once, and one step's chunk on top."""
    each = sequence_blocks(specs, context, 1, block_size)
    return max(0, num_blocks - step_blocks(specs, chunk, block_size)) // each
