"""The blocks themselves: reference counts, a free queue in eviction order, and the map from
content hash to cached block (prefix caching).

A block whose reference count drops to zero goes to the tail of the free queue but keeps its
hash: a later request with the same prefix can take it back (a cache hit) until allocation reaches
it at the head and evicts it. So the free queue is also the LRU list of reusable cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}          # content hash -> block id
        # told of each cached block just before it is evicted (its K/V still there): the tiers
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never used, or cached and unreferenced)."""
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:                       # evict the least recently freed cached block
                if self.on_evict is not None:
                    self.on_evict(block, h)
                del self.cached[h]
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (prefix-cache hits)."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop a reference; pass a sequence's blocks last-first so its tail is evicted first."""
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def cache(self, block: int, h: bytes) -> None:
        """Record that ``block`` holds the tokens hashed to ``h`` (first holder wins)."""
        if h not in self.cached and self.block_hash[block] is None:
            self.cached[h] = block
            self.block_hash[block] = h
