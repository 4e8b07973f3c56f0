"""The host-memory tier: blocks evicted from the K/V pool, kept in host RAM up to a byte limit,
least recently used given up first (to the disk tier, by whoever called ``put``).

Pure bookkeeping over ``bytes`` payloads: it never copies, so a payload must not change after
``put`` (pass ``bytes``, not a view of a pool tensor). Not thread-safe: one caller at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostCounters:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0       # payload bytes kept by put
    bytes_out: int = 0      # payload bytes served by get
    evicted: int = 0        # blocks given up to make room (returned by put)


class HostTier:
    """An LRU map of block key to payload, bounded by the payloads' total bytes."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"HostTier: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.counters = HostCounters()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()    # oldest first
        self._bytes = 0

    def put(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        """Keep ``payload`` as the most recently used; return what had to go, oldest first, for
        the caller to demote. A payload larger than ``max_bytes`` is not kept: it comes back at
        once (with ``max_bytes = 0`` every payload does)."""
        old = self._blocks.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        size = len(payload)
        if size > self.max_bytes:
            self.counters.evicted += 1
            return [(key, payload)]
        evicted: list[tuple[bytes, bytes]] = []
        while self._bytes + size > self.max_bytes:
            k, p = self._blocks.popitem(last=False)
            self._bytes -= len(p)
            evicted.append((k, p))
        self._blocks[key] = payload
        self._bytes += size
        self.counters.bytes_in += size
        self.counters.evicted += len(evicted)
        return evicted

    def get(self, key: bytes) -> bytes | None:
        """The payload, now the most recently used; None if not here."""
        payload = self._blocks.get(key)
        if payload is None:
            self.counters.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.counters.hits += 1
        self.counters.bytes_out += len(payload)
        return payload

    def pop(self, key: bytes) -> bytes | None:
        """Take a block out (it moved elsewhere, or its K/V is stale); None if not here."""
        payload = self._blocks.pop(key, None)
        if payload is not None:
            self._bytes -= len(payload)
        return payload

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every block, least recently used first, without touching their order."""
        return list(self._blocks.items())

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes_used(self) -> int:
        return self._bytes
