"""Host memory over disk: where evicted blocks go, where a lookup finds them, what a restart
keeps, and the ``[cache.offload]`` settings."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from twophase.cache.disk_tier import DiskTier
from twophase.cache.host_tier import HostTier
from twophase.cache.tiers import GiB, InvalidOffloadSetting, OffloadConfig, TieredStore

FP = hashlib.sha256(b"model a").digest()


def k(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def p(i: int) -> bytes:
    return bytes([i % 256]) * 100


def store(tmp_path, host_blocks: int = 2, disk: bool = True) -> TieredStore:
    host = HostTier(host_blocks * 100) if host_blocks is not None else None
    return TieredStore(host, DiskTier(tmp_path, 1 << 20, FP, fsync=False) if disk else None)


def test_evicted_blocks_go_to_host_and_what_host_gives_up_goes_to_disk(tmp_path):
    s = store(tmp_path)
    for i in range(5):
        s.put_evicted(k(i), p(i))
    assert [s.contains(k(i)) for i in range(6)] == ["disk", "disk", "disk", "host", "host", None]
    assert [e[0] for e in s.disk.entries()] == [k(0), k(1), k(2)]      # demoted oldest first
    assert s.get(k(4)) == (p(4), "host")
    assert s.get(k(0)) == (p(0), "disk")
    assert s.contains(k(0)) == "host" and s.contains(k(3)) == "disk"   # promoted; 3 pushed down
    assert s.get(k(9)) is None
    st = s.stats()
    assert (st["host_hits"], st["disk_hits"], st["misses"]) == (1, 1, 1)
    assert st["host_blocks"] == 2 and st["disk_blocks"] == 4 and st["host_bytes_used"] == 200
    assert st["disk_bytes_read"] == 100 and st["disk_bytes_written"] == 4 * s.disk.file_bytes(100, k(0))
    assert s.disk.get(k(0)) == p(0)                                    # the disk keeps its copy


def test_contains_reads_nothing(tmp_path, monkeypatch):
    s = store(tmp_path)
    for i in range(4):
        s.put_evicted(k(i), p(i))

    def no_read(key):
        raise AssertionError("read")

    monkeypatch.setattr(s.disk, "get", no_read)
    monkeypatch.setattr(s.host, "get", no_read)
    assert s.contains(k(0)) == "disk" and s.contains(k(3)) == "host" and s.contains(k(7)) is None


def test_restore_time_accumulates_over_reads(tmp_path):
    ticks = itertools.count()
    s = TieredStore(HostTier(1000), None, clock=lambda: float(next(ticks)))
    s.put_evicted(k(1), p(1))
    s.get(k(1))
    s.get(k(2))
    assert s.stats()["restore_seconds"] == 2.0


def test_without_host_memory_blocks_go_straight_to_disk_and_without_either_nowhere(tmp_path):
    s = store(tmp_path, host_blocks=None)
    s.put_evicted(k(1), p(1))
    assert s.contains(k(1)) == "disk" and s.get(k(1)) == (p(1), "disk")
    zero = store(tmp_path / "z", host_blocks=0)
    zero.put_evicted(k(1), p(1))
    assert zero.contains(k(1)) == "disk"
    none = TieredStore()
    none.put_evicted(k(1), p(1))
    assert none.get(k(1)) is None and none.contains(k(1)) is None and none.flush() == 0
    assert none.stats()["misses"] == 1


def test_a_restarted_store_finds_the_flushed_blocks_and_another_model_none(tmp_path):
    s = store(tmp_path, host_blocks=3)
    for i in range(5):
        s.put_evicted(k(i), p(i))
    assert s.flush() == 3
    cfg = OffloadConfig(host_gib=0.001, disk_dir=str(tmp_path), disk_gib=0.001)
    again = TieredStore.from_config(cfg, FP)
    assert all(again.get(k(i)) == (p(i), "disk") for i in range(5))
    other = TieredStore.from_config(cfg, hashlib.sha256(b"model b").digest())
    assert all(other.contains(k(i)) is None for i in range(5))


def test_offload_config_defaults_and_sizes():
    assert not OffloadConfig().enabled
    c = OffloadConfig(host_gib=1.5, disk_dir="/cache", disk_gib=2)
    assert c.enabled and c.host_bytes == 3 * GiB // 2 and c.disk_bytes == 2 * GiB
    s = TieredStore.from_config(OffloadConfig(host_gib=1), FP)
    assert s.host is not None and s.host.max_bytes == GiB and s.disk is None


@pytest.mark.parametrize("kwargs, field", [
    ({"host_gib": -1}, "host_gib"),
    ({"host_gib": float("nan")}, "host_gib"),
    ({"host_gib": "4"}, "host_gib"),
    ({"disk_dir": "/c", "disk_gib": -0.5}, "disk_gib"),
    ({"disk_gib": 10}, "disk_gib"),
    ({"disk_dir": "/c"}, "disk_gib"),
    ({"disk_dir": " ", "disk_gib": 1}, "disk_dir"),
])
def test_offload_config_refuses_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: ") as info:
        OffloadConfig(**kwargs)
    assert isinstance(info.value, InvalidOffloadSetting) and info.value.name == field
