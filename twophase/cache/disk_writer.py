"""The disk tier behind a writer thread, so a step never waits on a disk write.

Blocks reach the disk tier when the host tier gives them up, and that happens inside a step (the
pool evicts while allocating). A write is a file, an fsync and a rename: milliseconds each, on
the step's critical path if done there. Here ``put`` queues the block and returns; one thread
writes the queue out in order. A queued block is already a hit: ``get`` and ``in`` look in the
queue before the disk. The queue is bounded (``max_pending_bytes``): a disk slower than the
evictions drops the blocks that do not fit (counted in ``dropped``), never stalls a step; a
shutdown's flush, which has time, waits for room instead.

Reads still run on the caller's thread (a restore needs its block now); they wait at most for the
one write in progress, since the tier itself is guarded by one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from twophase.cache.disk_tier import DiskCounters, DiskTier

log = logging.getLogger(__name__)

DEFAULT_PENDING_BYTES = 256 << 20


class DiskWriter:
    """``DiskTier``'s put, get and ``in``, with puts written by a background thread."""

    def __init__(self, disk: DiskTier, max_pending_bytes: int = DEFAULT_PENDING_BYTES):
        self.disk = disk
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0                        # blocks refused because the queue was full
        self.cpu_seconds = 0.0                  # the writer thread's CPU time (checksums, copies)
        self._lock = threading.Lock()           # the tier: one caller at a time
        self._cond = threading.Condition()      # the queue
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()
        self._pending_bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="twophase-kv-disk", daemon=True)
        self._thread.start()

    def put(self, key: bytes, payload: bytes, wait: bool = False) -> bool:
        """Queue a block; False if the queue is full or the writer closed (the block is dropped).
        ``wait``: a full queue waits for room instead (a shutdown's flush, not a step)."""
        with self._cond:
            if key in self._pending:
                return True
            if wait:
                self._cond.wait_for(lambda: self._closed or not self._thread.is_alive() or not self._pending
                                    or self._pending_bytes + len(payload) <= self.max_pending_bytes)
            if self._closed or self._pending_bytes + len(payload) > self.max_pending_bytes and self._pending:
                self.dropped += 1
                return False
            self._pending[key] = payload
            self._pending_bytes += len(payload)
            self._cond.notify_all()
        return True

    def get(self, key: bytes) -> bytes | None:
        with self._cond:
            payload = self._pending.get(key)
        if payload is not None:
            with self._lock:
                self.disk.counters.hits += 1
                self.disk.counters.bytes_read += len(payload)
            return payload
        with self._lock:
            return self.disk.get(key)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            if key in self._pending:
                return True
        with self._lock:
            return key in self.disk

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending or not self._thread.is_alive(), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the thread."""
        self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                key, payload = next(iter(self._pending.items()))   # stays queued (a hit) until written
            start = time.thread_time()
            try:
                with self._lock:
                    self.disk.put(key, payload)
            except Exception:                   # the tier reports OS errors itself; anything else
                log.exception("disk KV cache: the writer failed on a block; dropped")
            self.cpu_seconds += time.thread_time() - start
            with self._cond:
                self._pending.pop(key, None)
                self._pending_bytes -= len(payload)
                self._cond.notify_all()

    # -- what TieredStore's stats read -------------------------------------------------------------

    @property
    def counters(self) -> DiskCounters:
        return self.disk.counters

    @property
    def bytes_used(self) -> int:
        return self.disk.bytes_used

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def __len__(self) -> int:
        return len(self.disk)
