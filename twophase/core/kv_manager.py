"""What each request holds in the paged KV pool: its block tables, and the hash chain of its
full blocks for prefix caching.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal
prefixes. A block is published to the cache only after its K/V have been computed.

The pool's layers come in groups (``KVGroups``): every layer alike is one group; a model mixing
full and sliding-window layers has a group per window kind and share of slots. A sequence has a
table per group, all from one ``BlockPool``. In a sliding group, a block whose tokens all lie
before the window of the next query is never read again: it goes back to the pool (still a
prefix-cache hit for others) and its table entry points at block 0, as padding does, which
attention masks. Such a group then holds about ``window / block_size + 1`` blocks a sequence
however long it grows, while a full group holds them all. A cached prefix is a hit only where
every full group holds all its blocks and every sliding group the blocks its continuation's
window reads (vLLM's rule for its hybrid cache).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from twophase.cache.pool_blocks import PoolBlocks, StateRows
from twophase.cache.spec import CacheSpec, FullAttentionSpec, cdiv, sequence_blocks
from twophase.cache.tiers import TieredStore
from twophase.core.block_pool import BlockPool
from twophase.core.seq_state import Seq


class SeqSlots(Protocol):
    """A per-sequence resource held from a sequence's first blocks to its last, as a state slot
    is (an adapter's slot): ``hold`` False means not now, and the sequence waits."""

    def hold(self, seq: Seq) -> bool: ...

    def drop(self, seq: Seq) -> None: ...

    def slot(self, seq: Seq) -> int: ...

STATE = b"state\0"          # a snapshot's key in the tiers: this, then its last block's chain hash
# a prefix hit: one list a group, each as long as the hit, 0 at a sliding group's passed blocks
Hit = Sequence[Sequence[int]]
FULL = FullAttentionSpec(1, 1, "float32")      # one group of full attention (its bytes are the layout's)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 specs: Sequence[CacheSpec] = (FULL,), state_slots: int = 0, snapshots: int = 0,
                 snapshot_every: int = 0, verify_rows: bool = False):
        self.pool = BlockPool(num_blocks)
        # state layers' rows: the running sequences' slots; with ``verify_rows`` as many again,
        # slot s's state before a verify step kept at row running + s; then the snapshots,
        # states saved at snapshot_every-token boundaries for prefix hits
        self.state_slots = state_slots                # 0: no state layers
        self.running_slots = running = (state_slots - snapshots) // (2 if verify_rows else 1)
        self.verify_rows = verify_rows
        self._free_slots = list(range(running))[::-1]
        self._slot_of: dict[str, int] = {}            # each running sequence's state slot
        self.snapshot_every = snapshot_every if snapshots and prefix_caching else 0
        self._snapshot_rows = list(range(state_slots - snapshots, state_slots))[::-1]
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()   # last block's chain hash -> row
        self._copies: list[tuple[int, int]] = []     # (from, to) state rows, for the next step
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.specs = tuple(specs)                     # each group's cache: how its blocks are freed
        self.windows = tuple(s.window for s in self.specs)   # each group's sliding window (None: full)
        self._dropped: dict[str, list[int]] = {}      # a group's leading blocks given back
        self.tables: dict[str, list[list[int]]] = {}  # a table a group, all of one length
        self._hashes: dict[str, list[bytes]] = {}      # chain hashes of each request's full blocks
        self._published: dict[str, int] = {}         # how many of its blocks are in the cache
        self.queries = 0                              # prefix-cache lookups, in tokens
        self.adapters: SeqSlots | None = None         # adapters' slots (LoRA), where served
        # where every block's hash chain starts (what produced the K/V: with tiers, the
        # fingerprint's root; a request's own ``cache_root``, its adapter, follows it)
        self.root = b""
        self.tiers: TieredStore | None = None         # host and disk below the pool
        self.blocks: PoolBlocks | None = None         # the pool's blocks as bytes, for the tiers
        self.state_rows: StateRows | None = None      # the state rows as bytes (state layers)
        self.restored = {"host": 0, "disk": 0}        # blocks copied back up into the pool
        self.hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Blocks a sequence of ``num_tokens`` holds at its peak, computed ``chunk`` at a time."""
        return sequence_blocks(self.specs, num_tokens, chunk, self.block_size)

    def block_table(self, req: Seq) -> list[int]:
        """The first group's table (a full-attention group's, where there is one)."""
        tables = self.tables.get(req.request_id)
        return tables[0] if tables else []

    def block_tables(self, req: Seq) -> list[list[int]]:
        return self.tables.get(req.request_id) or [[] for _ in self.windows]

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks a request holds a reference to, over all its groups."""
        dropped = self._dropped.get(request_id, [0] * self.num_groups)
        return [b for g, t in enumerate(self.tables.get(request_id, [])) for b in t[dropped[g]:]]

    def _key(self, h: bytes, group: int) -> bytes:
        return h if group == 0 else h + group.to_bytes(2, "little")

    def _dead(self, group: int, num_computed: int, length: int) -> int:
        """Leading blocks no query from position ``num_computed`` on reads in ``group`` (it sees
        keys after ``position - window``)."""
        w = self.windows[group]
        if w is None:
            return 0
        return min(length, max(0, (num_computed - w + 1) // self.block_size))

    def _chain(self, req: Seq, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs, toks = self.block_size, req.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            h = hashlib.sha256(hashes[-1] if hashes else self.root + getattr(req, "cache_root", b""))
            h.update(array("q", toks[i * bs:(i + 1) * bs]).tobytes())
            hashes.append(h.digest())      # sha256: a collision would silently reuse others' K/V
        return hashes[:num_blocks]

    def computed_blocks(self, req: Seq) -> Hit:
        """Cached blocks holding a prefix of ``req``'s tokens, a list a group. At least one token
        is always left to compute, since its logits are needed to sample."""
        if not self.prefix_caching or not getattr(req, "may_hit_prefix", True):   # (Request's)
            return []
        chain = self._chain(req, (req.num_tokens - 1) // self.block_size)
        if self.tiers is not None:
            self._restore(chain)
        found = [[self.pool.lookup(self._key(h, g)) for h in chain] for g in range(self.num_groups)]
        k = len(chain)
        for g, w in enumerate(self.windows):
            if w is None:
                k = min(k, next((i for i, b in enumerate(found[g]) if b is None), k))

        def usable(k: int) -> bool:
            return all(b is not None for g, w in enumerate(self.windows) if w is not None
                       for b in found[g][self._dead(g, k * self.block_size, k):k])

        while k and not (usable(k) and self._restorable(chain, k)):
            k -= 1
        if k == 0:
            return []
        return [[0 if b is None or i < self._dead(g, k * self.block_size, k) else b
                 for i, b in enumerate(found[g][:k])] for g in range(self.num_groups)]

    def use_tiers(self, tiers: TieredStore, blocks: PoolBlocks, root: bytes,
                  state_rows: StateRows | None = None) -> None:
        """Blocks the pool evicts go to ``tiers``, and so do the prefix snapshots of a model with
        state layers (``state_rows``) when their rows are taken; a lookup brings both back."""
        self.tiers, self.blocks, self.root, self.state_rows = tiers, blocks, root, state_rows
        self.pool.on_evict = lambda block, key: tiers.evict_from(key, lambda: blocks.read(block))

    def save_cached(self) -> int:
        """Every cached block the pool holds, into the tiers (at shutdown: with the host tier's
        blocks they go to disk, for the next start); the number saved."""
        if self.tiers is None or self.blocks is None:
            return 0
        for key, block in list(self.pool.cached.items()):
            self.tiers.put_evicted(key, self.blocks.read(block))
        if self.state_rows is not None:
            for h, row in self._snapshots.items():
                self.tiers.put_evicted(STATE + h, self.state_rows.read(row))
        return len(self.pool.cached) + len(self._snapshots)

    def tier_stats(self) -> dict[str, float] | None:
        """The tiers' counters (hits, bytes moved and held, restore seconds) and the blocks
        restored from each; None without tiers."""
        if self.tiers is None:
            return None
        return {**self.tiers.stats(), **{f"{t}_restored_blocks": n for t, n in self.restored.items()}}

    def _restore(self, chain: list[bytes]) -> None:
        """The chain's blocks a hit can read that the pool lacks and a tier holds, copied back up
        into free cached blocks (then a lookup finds them as it finds any cached block), in each
        group up to its first block no tier holds; the chain's blocks the pool has are held
        meanwhile, so making room never evicts them. A hit reaches as far as every full group's
        blocks go, and a sliding group's blocks before that end's window are left where they are:
        restored, they would take the room the blocks the hit reads need."""
        assert self.tiers is not None and self.blocks is not None
        if self.state_rows is not None and self.snapshot_every:
            self._restore_snapshot(chain)
        keys = [[self._key(h, g) for h in chain] for g in range(self.num_groups)]
        held = [b for ks in keys for k in ks if (b := self.pool.lookup(k)) is not None]
        self.pool.touch(held)
        try:
            k = self._reachable(keys)
            self._restore_blocks([ks[self._dead(g, k * self.block_size, k):k] for g, ks in enumerate(keys)])
        finally:
            self.pool.release(held[::-1])

    def _reachable(self, keys: list[list[bytes]]) -> int:
        """Blocks of the chain a hit may reach: every full group's leading blocks that the pool
        or a tier holds (where every group slides, the whole chain)."""
        assert self.tiers is not None
        k = len(keys[0]) if keys else 0
        for g, w in enumerate(self.windows):
            if w is None:
                k = min(k, next((i for i, key in enumerate(keys[g][:k])
                                 if self.pool.lookup(key) is None and self.tiers.contains(key) is None), k))
        return k

    def _restore_blocks(self, keys: list[list[bytes]]) -> None:
        assert self.tiers is not None and self.blocks is not None
        restored = 0
        for group_keys in keys:
            for key in group_keys:
                if self.pool.lookup(key) is not None:
                    continue
                if self.tiers.contains(key) is None or self.pool.num_free <= restored + 1:
                    break
                got = self.tiers.get(key)
                if got is None:                    # damaged on disk: a miss
                    break
                block = self.pool.allocate(1)[0]   # the least recently used free block goes down
                self.blocks.write(block, got[0])
                self.pool.cache(block, key)
                self.pool.release([block])
                self.restored[got[1]] += 1
                restored += 1

    def _restorable(self, chain: list[bytes], k: int) -> bool:
        """A hit of ``k`` blocks restores its state layers' state: none, or one saved there."""
        if not self.state_slots:
            return True
        return bool(self.snapshot_every) and k * self.block_size % self.snapshot_every == 0 \
            and chain[k - 1] in self._snapshots

    def cut_chunk(self, start: int, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``start``, ended at the next snapshot boundary
        it would cross, so the state there can be saved."""
        if not self.snapshot_every:
            return n
        boundary = (start // self.snapshot_every + 1) * self.snapshot_every
        return boundary - start if start + n > boundary else n

    def _snapshot(self, req: Seq) -> None:
        """Save ``req``'s state where its computed tokens end on a snapshot boundary (in a free
        row, else the least recently used one's)."""
        n = req.num_computed_tokens
        if not self.snapshot_every or n == 0 or n % self.snapshot_every or req.request_id not in self._slot_of:
            return
        key = self._chain(req, n // self.block_size)[-1]
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        if self._snapshot_rows:
            row = self._snapshot_rows.pop()
        elif self._snapshots:
            row = self._take_snapshot_row()
        else:
            return
        self._snapshots[key] = row
        self._copies.append((self._slot_of[req.request_id], row))

    def _take_snapshot_row(self) -> int:
        """The least recently used snapshot's row, its state first saved to the tiers."""
        old, row = self._snapshots.popitem(last=False)
        if self.tiers is not None and self.state_rows is not None:
            self.tiers.put_evicted(STATE + old, self.state_rows.read(row))
        return row

    def _restore_snapshot(self, chain: list[bytes]) -> None:
        """The longest snapshot boundary of ``chain`` whose state a tier holds and no row does,
        brought back into a row (a free one, else the least recently used one not about to be
        written by a queued copy)."""
        assert self.tiers is not None and self.state_rows is not None
        every = self.snapshot_every // self.block_size
        for k in range(len(chain) // every * every, 0, -every):
            h = chain[k - 1]
            if h in self._snapshots:
                return
            if self.tiers.contains(STATE + h) is None:
                continue
            pending = {to for _, to in self._copies}
            if not self._snapshot_rows and (not self._snapshots or next(iter(self._snapshots.values())) in pending):
                return
            got = self.tiers.get(STATE + h)
            if got is None:
                return
            row = self._snapshot_rows.pop() if self._snapshot_rows else self._take_snapshot_row()
            self.state_rows.write(row, got[0])
            self._snapshots[h] = row
            self.restored[got[1]] += 1
            return

    def keep_state(self, req: Seq) -> None:
        """Before ``req``'s drafts are verified: keep its state, which a rejected draft would
        leave ahead of its kept tokens (``restore_state``)."""
        if self.state_slots:
            slot = self._slot_of[req.request_id]
            self._copies.append((slot, self.running_slots + slot))

    def restore_state(self, req: Seq) -> None:
        """``req``'s state as ``keep_state`` kept it, before the verify step's tokens: the
        scheduler then computes its kept tokens again (a recompute of a few tokens, exact for
        any kind of state layer)."""
        slot = self._slot_of[req.request_id]
        self._copies.append((self.running_slots + slot, slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The state rows to copy before the next step computes, in order (and forget them)."""
        out, self._copies = self._copies, []
        return out

    def hit_tokens(self, computed: Hit) -> int:
        return len(computed[0]) * self.block_size if computed else 0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def blocks_needed(self, req: Seq, num_new_tokens: int, computed: Hit = ()) -> int:
        """New blocks ``req`` needs for ``num_new_tokens`` more tokens (after ``computed`` hits),
        over all its groups."""
        have = len(self.block_table(req)) + (len(computed[0]) if computed else 0)
        total = req.num_computed_tokens + self.hit_tokens(computed) + num_new_tokens
        return max(0, self.blocks_for(total) - have) * self.num_groups

    def growth_blocks(self, req: Seq, num_tokens: int) -> int:
        """Blocks ``req`` takes on reaching ``num_tokens`` (admission's reserve): a sliding group
        stops growing at its window."""
        table, rid = self.block_table(req), req.request_id
        dropped = self._dropped.get(rid, [0] * self.num_groups)
        more = max(0, self.blocks_for(num_tokens) - len(table))
        return sum(more if s.window is None else
                   max(0, min(more, s.live_blocks(num_tokens, 1, self.block_size) - (len(table) - d)))
                   for s, d in zip(self.specs, dropped))

    def allocate(self, req: Seq, num_new_tokens: int, computed: Hit = ()) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after ``computed`` hits, on
        admission). False, with nothing changed, if the pool cannot."""
        rid = req.request_id
        need = self.blocks_needed(req, num_new_tokens, computed) // self.num_groups
        k = len(computed[0]) if computed else 0
        dead = [self._dead(g, k * self.block_size, k) for g in range(self.num_groups)]
        live = [b for g, hit in enumerate(computed) for b in hit[dead[g]:]]
        reusable = sum(1 for b in set(live) if self.pool.ref_cnt[b] == 0)   # hits in free queue
        if need * self.num_groups > self.pool.num_free - reusable:
            return False
        if self.state_slots and rid not in self._slot_of and not self._free_slots:
            return False
        if self.adapters is not None and rid not in self.tables and not self.adapters.hold(req):
            return False
        if self.state_slots and rid not in self._slot_of:
            self._slot_of[rid] = self._free_slots.pop()
            if computed:               # the prefix's saved state into the sequence's slot
                row = self._snapshots[self._chain(req, k)[-1]]
                self._snapshots.move_to_end(self._chain(req, k)[-1])
                self._copies.append((row, self._slot_of[rid]))
        self.pool.touch(live)
        tables = self.block_tables(req)
        if computed:
            self._dropped[rid] = dead
        self.tables[rid] = [t + list(computed[g] if computed else ()) + self.pool.allocate(need)
                            for g, t in enumerate(tables)]
        return True

    def fork(self, parent: Seq, child: Seq, num_tokens: int) -> bool:
        """``child`` (a new sequence with the same prompt) takes ``parent``'s blocks holding its
        first ``num_tokens`` tokens (whole blocks: a reference more each, nothing copied), and
        a copy of its state where the model keeps one (so the parent must have computed exactly
        ``num_tokens``). False, with nothing changed, if no state slot is free."""
        if self.state_slots and not self._free_slots:
            return False
        if self.adapters is not None and not self.adapters.hold(child):
            return False
        k, rid = num_tokens // self.block_size, child.request_id
        dropped = [min(d, k) for d in self._dropped.get(parent.request_id, [0] * self.num_groups)]
        shared = [t[:k] for t in self.tables[parent.request_id]]
        self.pool.touch([b for g, t in enumerate(shared) for b in t[dropped[g]:]])
        self.tables[rid] = [list(t) for t in shared]
        self._dropped[rid] = dropped
        if self.state_slots:
            self._slot_of[rid] = self._free_slots.pop()
            self._copies.append((self._slot_of[parent.request_id], self._slot_of[rid]))
        return True

    def cache_computed(self, req: Seq) -> None:
        """Publish ``req``'s blocks that are full and computed, so later requests can hit them
        (and its state, where its computed tokens end on a snapshot boundary)."""
        if not self.prefix_caching:
            return
        self._snapshot(req)
        rid = req.request_id
        tables = self.tables[rid]
        n = min(req.num_computed_tokens // self.block_size, len(tables[0]))
        done = self._published.get(rid, 0)
        if n <= done:
            return
        chain = self._chain(req, n)
        dropped = self._dropped.get(rid, [0] * self.num_groups)
        for g, table in enumerate(tables):
            for i in range(max(done, dropped[g]), n):
                self.pool.cache(table[i], self._key(chain[i], g))
        self._published[rid] = n

    def release_outside_window(self, req: Seq) -> None:
        """In each sliding group, give back the blocks wholly before the window of ``req``'s
        next query (at position ``num_computed_tokens``). Queries never move back past it: a
        rollback only drops tokens computed after it."""
        tables = self.tables.get(req.request_id)
        if not tables or all(w is None for w in self.windows):
            return
        dropped = self._dropped.setdefault(req.request_id, [0] * self.num_groups)
        for g, table in enumerate(tables):
            dead = self._dead(g, req.num_computed_tokens, len(table))
            if dead > dropped[g]:
                self.pool.release(table[dropped[g]:dead][::-1])
                table[dropped[g]:dead] = [0] * (dead - dropped[g])
                dropped[g] = dead

    def truncate(self, req: Seq, num_tokens: int) -> None:
        """Keep only the blocks that hold ``req``'s first ``num_tokens`` tokens (a rollback:
        speculative tokens rejected). Slots past the new length are simply overwritten later;
        a block wholly past it goes back to the pool. Only computed tokens were ever published
        to the prefix cache, so a rolled-back block was never a hit for anyone."""
        rid = req.request_id
        published = self._published.get(rid, 0)
        full = num_tokens // self.block_size
        if published > full:
            raise RuntimeError(f"truncating {rid} to {num_tokens} tokens would drop "
                               f"{published - full} published (committed) blocks")
        tables = self.tables.get(rid)
        keep = self.blocks_for(num_tokens)
        if tables and keep < len(tables[0]):
            dropped = self._dropped.get(rid, [0] * self.num_groups)
            for g, table in enumerate(tables):
                self.pool.release(table[max(keep, dropped[g]):][::-1])
                del table[keep:]
                dropped[g] = min(dropped[g], keep)
        hashes = self._hashes.get(rid)
        if hashes is not None:
            del hashes[full:]

    def state_slot(self, req: Seq) -> int:
        """The state slot ``req`` holds (a model with state layers; one from its first blocks)."""
        return self._slot_of[req.request_id]

    def adapter_slot(self, req: Seq) -> int:
        """The adapter slot ``req`` holds; -1: the base model."""
        return -1 if self.adapters is None else self.adapters.slot(req)

    def free(self, req: Seq) -> None:
        rid = req.request_id
        if self.adapters is not None:
            self.adapters.drop(req)
        if rid in self._slot_of:
            self._free_slots.append(self._slot_of.pop(rid))
        tables = self.tables.pop(rid, None) or []
        self._hashes.pop(rid, None)
        self._published.pop(rid, None)
        dropped = self._dropped.pop(rid, [0] * self.num_groups)
        for g, table in enumerate(tables):
            self.pool.release(table[dropped[g]:][::-1])
