"""The tiers below the K/V pool, together: host memory, then disk.

Blocks the pool evicts go to host memory (``put_evicted``); what host memory gives up goes to
disk. A lookup searches host then disk, and a disk hit is promoted back into host memory (its
file stays, so a restart still finds it). The disk tier is inclusive: a block promoted and later
demoted again is only marked recently used there, not rewritten. ``flush`` writes what host
memory holds to disk, for a shutdown that wants a restarted server to find it.

The pool itself is the top tier; the engine asks the pool first and this store on a pool miss.
Not thread-safe: one caller at a time. Built from the config, its disk tier writes on a thread of
its own (``DiskWriter``): a step that evicts never waits on a disk write.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from twophase.cache.disk_tier import DiskTier
from twophase.cache.disk_writer import DiskWriter
from twophase.cache.host_tier import HostTier

GiB = 1 << 30
TIERS = ("host", "disk")


class InvalidOffloadSetting(ValueError):
    """A bad ``[cache.offload]`` value; ``name`` is the field, ``message`` what is allowed (the
    config loader reports it as ``cache.offload.<name>``)."""

    def __init__(self, name: str, message: str):
        self.name = name
        self.message = message
        super().__init__(f"{name}: {message}")


@dataclass
class OffloadConfig:
    """``[cache.offload]``: where blocks the pool evicts go. Both tiers are off by default."""

    host_gib: float = 0                 # host memory for evicted blocks; 0: none
    disk_dir: str | None = None         # folder of the disk tier (blocks of each model apart)
    disk_gib: float = 0                 # disk for blocks host memory gives up; needs disk_dir

    def __post_init__(self) -> None:
        for name in ("host_gib", "disk_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidOffloadSetting(name, f"must be a number of GiB, got {v!r}")
            if not math.isfinite(v) or v < 0:
                raise InvalidOffloadSetting(name, f"must be a finite number of GiB >= 0, got {v}")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str) or not self.disk_dir.strip()):
            raise InvalidOffloadSetting("disk_dir", f"must be a folder's path, got {self.disk_dir!r}")
        if self.disk_gib > 0 and self.disk_dir is None:
            raise InvalidOffloadSetting("disk_gib", "needs disk_dir: the folder the disk tier keeps its blocks in")
        if self.disk_dir is not None and self.disk_gib == 0:
            raise InvalidOffloadSetting("disk_gib", f"must be > 0 to use disk_dir {self.disk_dir!r} "
                                        f"(leave disk_dir out to turn the disk tier off)")

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * GiB)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gib * GiB)

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


class TieredStore:
    """Host memory over disk, either of which may be absent."""

    def __init__(self, host: HostTier | None = None, disk: DiskTier | DiskWriter | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.host = host
        self.disk = disk
        self._clock = clock
        self.misses = 0
        self.restore_seconds = 0.0      # time spent in get: what a tier hit costs before compute
        self.offload_seconds = 0.0      # time spent in evict_from: what handing blocks down costs a step

    @classmethod
    def from_config(cls, cfg: OffloadConfig, fingerprint: bytes) -> TieredStore:
        host = HostTier(cfg.host_bytes) if cfg.host_bytes else None
        disk = DiskWriter(DiskTier(cfg.disk_dir, cfg.disk_bytes, fingerprint), min(cfg.disk_bytes, 256 << 20)) \
            if cfg.disk_dir and cfg.disk_bytes else None
        return cls(host, disk)

    def put_evicted(self, key: bytes, payload: bytes) -> None:
        """A block the pool gave up: into host memory, and what that pushes out, onto disk (with
        no host tier, straight to disk; with neither, dropped)."""
        demoted = self.host.put(key, payload) if self.host is not None else [(key, payload)]
        self._demote(demoted)

    def evict_from(self, key: bytes, read: Callable[[], bytes]) -> None:
        """``put_evicted`` of a block copied out of the pool now (``read``), timed: the pool
        evicts inside a step, so this is the tiers' cost to it."""
        start = self._clock()
        try:
            self.put_evicted(key, read())
        finally:
            self.offload_seconds += self._clock() - start

    def _demote(self, blocks: list[tuple[bytes, bytes]]) -> None:
        if self.disk is not None:
            for k, p in blocks:
                self.disk.put(k, p)

    def get(self, key: bytes) -> tuple[bytes, str] | None:
        """``(payload, tier)`` from the first tier holding ``key``, or None. A disk hit moves into
        host memory (what that pushes out goes to disk)."""
        start = self._clock()
        try:
            if self.host is not None:
                payload = self.host.get(key)
                if payload is not None:
                    return payload, "host"
            if self.disk is not None:
                payload = self.disk.get(key)
                if payload is not None:
                    if self.host is not None:
                        self._demote(self.host.put(key, payload))
                    return payload, "disk"
            self.misses += 1
            return None
        finally:
            self.restore_seconds += self._clock() - start

    def contains(self, key: bytes) -> str | None:
        """The tier a ``get`` would read from, without reading (from the tiers' indexes): the
        scheduler can count a hit before paying for it. A disk file found damaged on the read is
        still a miss then."""
        if self.host is not None and key in self.host:
            return "host"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def flush(self) -> int:
        """Write every block host memory holds to disk (kept in host memory too); the number
        written or already there. For a shutdown: host memory does not survive a restart."""
        if self.disk is None:
            return 0
        if self.host is None:
            return 0
        if isinstance(self.disk, DiskWriter):             # more than the writer's queue holds: wait
            written = sum(self.disk.put(k, p, wait=True) for k, p in self.host.items())
            self.disk.drain()
        else:
            written = sum(self.disk.put(k, p) for k, p in self.host.items())
        return written

    def close(self) -> None:
        """Stop the disk writer once what it has queued is written."""
        if isinstance(self.disk, DiskWriter):
            self.disk.close()

    def stats(self) -> dict[str, float]:
        """Counters for /metrics: hits by tier, bytes moved, bytes held, restore time."""
        out: dict[str, float] = {"misses": self.misses, "restore_seconds": self.restore_seconds,
                                 "offload_seconds": self.offload_seconds}
        h, d = self.host, self.disk
        out.update({
            "host_hits": h.counters.hits if h else 0,
            "host_bytes_in": h.counters.bytes_in if h else 0,
            "host_bytes_out": h.counters.bytes_out if h else 0,
            "host_bytes_used": h.bytes_used if h else 0,
            "host_blocks": len(h) if h else 0,
            "host_evicted": h.counters.evicted if h else 0,
            "disk_hits": d.counters.hits if d else 0,
            "disk_bytes_written": d.counters.bytes_written if d else 0,
            "disk_bytes_read": d.counters.bytes_read if d else 0,
            "disk_bytes_used": d.bytes_used if d else 0,
            "disk_blocks": len(d) if d else 0,
            "disk_evicted": d.counters.evicted if d else 0,
            "disk_corrupt": d.counters.corrupt if d else 0,
            "disk_write_errors": d.counters.write_errors if d else 0,
            "disk_read_errors": d.counters.read_errors if d else 0,
            "disk_dropped": d.dropped if isinstance(d, DiskWriter) else 0,
            "disk_pending_bytes": d.pending_bytes if isinstance(d, DiskWriter) else 0,
            "disk_writer_cpu_seconds": d.cpu_seconds if isinstance(d, DiskWriter) else 0,
        })
        return out
