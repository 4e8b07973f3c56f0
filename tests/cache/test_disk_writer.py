"""The disk tier's writer thread: a put returns while the disk is busy, a queued block is already
a hit, a full queue drops rather than waits, and closing writes everything out."""

from __future__ import annotations

import hashlib
import threading

from twophase.cache.disk_tier import DiskTier
from twophase.cache.disk_writer import DiskWriter
from twophase.cache.host_tier import HostTier
from twophase.cache.tiers import OffloadConfig, TieredStore

FP = hashlib.sha256(b"model a").digest()


def k(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def p(i: int) -> bytes:
    return bytes([i % 256]) * 100


def _returns_within(fn, seconds: float = 5.0):
    """``fn()``'s result if it returns within ``seconds``; a put that waited on the held disk
    would not."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, "the call waited on the disk"
    return out[0]


def test_a_put_returns_while_the_disk_is_busy_and_is_a_hit_meanwhile(tmp_path):
    w = DiskWriter(DiskTier(tmp_path, 1 << 20, FP, fsync=False))
    with w._lock:                                           # the disk is busy: nothing gets written
        assert _returns_within(lambda: w.put(k(1), p(1))) is True
        assert _returns_within(lambda: k(1) in w)
        assert w.pending_bytes == 100 and len(w.disk) == 0
        assert w._pending[k(1)] == p(1)
    assert w.get(k(1)) == p(1)
    assert w.drain(5.0) and w.pending_bytes == 0
    assert k(1) in w.disk and w.disk.path_for(k(1)).exists()
    w.close(5.0)


def test_a_full_queue_drops_the_block_and_counts_it(tmp_path):
    w = DiskWriter(DiskTier(tmp_path, 1 << 20, FP, fsync=False), max_pending_bytes=250)
    with w._lock:
        assert [_returns_within(lambda i=i: w.put(k(i), p(i))) for i in range(3)] == [True, True, False]
    assert w.dropped == 1
    w.close(5.0)
    assert k(0) in w.disk and k(1) in w.disk and k(2) not in w.disk
    assert w.put(k(5), p(5)) is False                       # closed: dropped, not an error


def test_flush_and_close_leave_every_block_on_disk_for_a_restart(tmp_path):
    cfg = OffloadConfig(host_gib=1, disk_dir=str(tmp_path), disk_gib=1)
    s = TieredStore.from_config(cfg, FP)
    assert isinstance(s.disk, DiskWriter) and isinstance(s.host, HostTier)
    s.disk.max_pending_bytes = 250                          # the flush holds more than the queue
    for i in range(20):
        s.put_evicted(k(i), p(i))
    assert s.flush() == 20
    s.close()
    again = TieredStore.from_config(cfg, FP)
    assert [again.contains(k(i)) for i in range(20)] == ["disk"] * 20
    assert again.get(k(7)) == (p(7), "disk")
    assert again.stats()["disk_dropped"] == 0
    again.close()
