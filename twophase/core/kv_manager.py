"""What each request holds in the paged KV pool: its block table, and the hash chain of its
full blocks for prefix caching.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal
prefixes. A block is published to the cache only after its K/V have been computed.

In a model whose every layer attends over a sliding window, a block whose tokens all lie before
the window of the next query is never read again: it goes back to the pool (still a prefix-cache
hit for others) and its table entry points at block 0, as padding does, which attention masks.
A sequence then holds about ``window / block_size + 1`` blocks however long it grows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from twophase.core.block_pool import BlockPool
from twophase.core.seq_state import Seq


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 window: int | None = None):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window                          # every layer's sliding window, if all slide
        self._dropped: dict[str, int] = {}           # leading blocks given back (window passed)
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}      # chain hashes of each request's full blocks
        self._published: dict[str, int] = {}         # how many of its blocks are in the cache
        self.queries = 0                              # prefix-cache lookups, in tokens
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, req: Seq) -> list[int]:
        return self.tables.get(req.request_id, [])

    def _chain(self, req: Seq, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs, toks = self.block_size, req.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            h = hashlib.sha256(hashes[-1] if hashes else b"")
            h.update(array("q", toks[i * bs:(i + 1) * bs]).tobytes())
            hashes.append(h.digest())      # sha256: a collision would silently reuse others' K/V
        return hashes[:num_blocks]

    def computed_blocks(self, req: Seq) -> list[int]:
        """Cached blocks holding a prefix of ``req``'s tokens. At least one token is always left
        to compute, since its logits are needed to sample."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in self._chain(req, (req.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def blocks_needed(self, req: Seq, num_new_tokens: int, computed: Sequence[int] = ()) -> int:
        """New blocks ``req`` needs for ``num_new_tokens`` more tokens (after ``computed`` hits)."""
        have = len(self.tables.get(req.request_id, [])) + len(computed)
        cached_tokens = len(computed) * self.block_size
        return self.blocks_for(req.num_computed_tokens + cached_tokens + num_new_tokens) - have

    def allocate(self, req: Seq, num_new_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after ``computed`` hits, on
        admission). False, with nothing changed, if the pool cannot."""
        table = self.tables.get(req.request_id, [])
        need = self.blocks_needed(req, num_new_tokens, computed)
        reusable = sum(1 for b in computed if self.pool.ref_cnt[b] == 0)   # hits now in free queue
        if need > self.pool.num_free - reusable:
            return False
        self.pool.touch(list(computed))
        table = table + list(computed) + self.pool.allocate(max(need, 0))
        self.tables[req.request_id] = table
        return True

    def cache_computed(self, req: Seq) -> None:
        """Publish ``req``'s blocks that are full and computed, so later requests can hit them."""
        if not self.prefix_caching:
            return
        table = self.tables[req.request_id]
        n = min(req.num_computed_tokens // self.block_size, len(table))
        done = self._published.get(req.request_id, 0)
        for block, h in zip(table[done:n], self._chain(req, n)[done:]):
            self.pool.cache(block, h)
        self._published[req.request_id] = max(done, n)

    def release_outside_window(self, req: Seq) -> None:
        """Give back the blocks wholly before the window of ``req``'s next query (at position
        ``num_computed_tokens``: it sees keys after ``position - window``). Queries never move
        back past it: a rollback only drops tokens computed after it."""
        if self.window is None:
            return
        table = self.tables.get(req.request_id)
        if not table:
            return
        dead = min(len(table), max(0, (req.num_computed_tokens - self.window + 1) // self.block_size))
        done = self._dropped.get(req.request_id, 0)
        if dead > done:
            self.pool.release(table[done:dead][::-1])
            table[done:dead] = [0] * (dead - done)
            self._dropped[req.request_id] = dead

    def truncate(self, req: Seq, num_tokens: int) -> None:
        """Keep only the blocks that hold ``req``'s first ``num_tokens`` tokens (a rollback:
        speculative tokens rejected). Slots past the new length are simply overwritten later;
        a block wholly past it goes back to the pool. Only computed tokens were ever published
        to the prefix cache, so a rolled-back block was never a hit for anyone."""
        published = self._published.get(req.request_id, 0)
        full = num_tokens // self.block_size
        if published > full:
            raise RuntimeError(f"truncating {req.request_id} to {num_tokens} tokens would drop "
                               f"{published - full} published (committed) blocks")
        table = self.tables.get(req.request_id, [])
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.tables[req.request_id] = table[:keep]
            self.pool.release(table[keep:][::-1])
        hashes = self._hashes.get(req.request_id)
        if hashes is not None:
            del hashes[full:]

    def free(self, req: Seq) -> None:
        table = self.tables.pop(req.request_id, [])
        self._hashes.pop(req.request_id, None)
        self._published.pop(req.request_id, None)
        dropped = self._dropped.pop(req.request_id, 0)
        self.pool.release(table[dropped:][::-1])
