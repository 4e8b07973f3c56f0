"""The disk tier on an ordinary folder: round trips, the file format, LRU by mtime across
restarts, the byte limit, damaged files, leftover temp files, listing and clearing."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys

import pytest

from twophase.cache import disk_tier
from twophase.cache.disk_tier import MAGIC, DiskTier, FolderUsage, clear_root, folders

FP = hashlib.sha256(b"model a").digest()
OTHER_FP = hashlib.sha256(b"model b").digest()


def k(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def payload(i: int, size: int = 1000) -> bytes:
    return (hashlib.sha256(b"payload %d" % i).digest() * (size // 32 + 1))[:size]


def tier(path, max_bytes: int = 1 << 20, fp: bytes = FP) -> DiskTier:
    return DiskTier(path, max_bytes, fp, fsync=False)


def block_bytes(size: int = 1000) -> int:
    """A block's file: the 24-byte header, the fingerprint and the key (32 bytes each), the payload."""
    return 24 + 32 + 32 + size


def test_round_trip_layout_and_header(tmp_path):
    t = tier(tmp_path)
    assert t.put(k(1), payload(1)) and t.get(k(1)) == payload(1)
    path = tmp_path / FP.hex()[:16] / k(1).hex()[:2] / (k(1).hex() + ".kv")
    assert t.path_for(k(1)) == path and path.is_file()
    raw = path.read_bytes()
    assert raw.startswith(MAGIC) and raw.endswith(payload(1)) and FP + k(1) in raw
    assert len(raw) == t.file_bytes(1000, k(1)) == block_bytes() == t.bytes_used
    assert k(1) in t and len(t) == 1 and t.get(k(2)) is None
    c = t.counters
    assert (c.hits, c.misses, c.bytes_written, c.bytes_read, c.corrupt) == (1, 1, len(raw), 1000, 0)
    assert t.put(k(3), b"") and t.get(k(3)) == b""


def test_putting_a_block_already_there_does_not_write_it_again(tmp_path):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    written = t.counters.bytes_written
    inode = t.path_for(k(1)).stat().st_ino
    assert t.put(k(1), payload(1))
    assert t.counters.bytes_written == written and t.path_for(k(1)).stat().st_ino == inode


def test_the_byte_limit_removes_the_least_recently_used_files(tmp_path):
    t = tier(tmp_path, max_bytes=3 * block_bytes())
    for i in (1, 2, 3):
        assert t.put(k(i), payload(i))
    assert t.get(k(1)) == payload(1)                # order now 2, 3, 1
    assert t.put(k(4), payload(4))
    assert k(2) not in t and not t.path_for(k(2)).exists()
    assert [e[0] for e in t.entries()] == [k(3), k(1), k(4)]
    for i in range(5, 30):
        t.put(k(i), payload(i))
        on_disk = sum(p.stat().st_size for p in (tmp_path / FP.hex()[:16]).rglob("*.kv"))
        assert on_disk == t.bytes_used <= t.max_bytes
    assert t.counters.evicted == 26


def test_a_block_larger_than_the_limit_is_not_written(tmp_path):
    t = tier(tmp_path, max_bytes=block_bytes() - 1)
    assert not t.put(k(1), payload(1)) and len(t) == 0 and t.counters.write_errors == 0
    assert not (tmp_path / FP.hex()[:16]).exists()
    z = tier(tmp_path / "zero", max_bytes=0)
    assert not z.put(k(1), b"") and len(z) == 0


def test_a_restart_finds_the_blocks_and_their_recency(tmp_path):
    t = tier(tmp_path)
    for i in (1, 2, 3):
        t.put(k(i), payload(i))
        os.utime(t.path_for(k(i)), (1_000_000 + i, 1_000_000 + i))   # written in order 1, 2, 3
    again = tier(tmp_path)
    assert len(again) == 3 and again.bytes_used == t.bytes_used
    assert [e[0] for e in again.entries()] == [k(1), k(2), k(3)]
    assert again.get(k(1)) == payload(1)            # a read refreshes the file's mtime
    third = tier(tmp_path, max_bytes=2 * block_bytes())   # a lower limit trims at open
    assert k(2) not in third and [e[0] for e in third.entries()] == [k(3), k(1)]
    assert third.get(k(3)) == payload(3) and third.get(k(1)) == payload(1)


def test_another_fingerprint_sees_none_of_the_blocks_and_keeps_them(tmp_path):
    tier(tmp_path).put(k(1), payload(1))
    other = tier(tmp_path, fp=OTHER_FP)
    assert len(other) == 0 and other.get(k(1)) is None
    other.put(k(1), payload(2))
    assert tier(tmp_path).get(k(1)) == payload(1) and tier(tmp_path, fp=OTHER_FP).get(k(1)) == payload(2)


def test_a_miss_does_not_touch_the_filesystem(tmp_path, monkeypatch):
    t = tier(tmp_path)
    t.put(k(1), payload(1))

    def no_io(*args, **kwargs):
        raise AssertionError("the filesystem was touched")

    monkeypatch.setattr(disk_tier, "open", no_io, raising=False)
    monkeypatch.setattr(disk_tier.os, "stat", no_io)
    monkeypatch.setattr(disk_tier.os, "scandir", no_io)
    assert t.get(k(2)) is None and k(2) not in t
    monkeypatch.undo()
    assert t.get(k(1)) == payload(1)


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


DAMAGE = {
    "payload bit": lambda p: _flip(p, -1),
    "first payload bit": lambda p: _flip(p, 24 + 64),
    "magic": lambda p: _flip(p, 0),
    "version": lambda p: _flip(p, 8),
    "stored key": lambda p: _flip(p, 24 + 40),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-10]),
    "header only": lambda p: p.write_bytes(p.read_bytes()[:30]),
    "empty": lambda p: p.write_bytes(b""),
    "bytes appended": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_a_miss_removed_and_counted(tmp_path, damage, caplog):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    t.put(k(2), payload(2))
    DAMAGE[damage](t.path_for(k(1)))
    with caplog.at_level(logging.WARNING, "twophase.cache.disk_tier"):
        assert t.get(k(1)) is None
    assert not t.path_for(k(1)).exists() and k(1) not in t
    assert t.counters.corrupt == 1 and t.counters.misses == 1 and len(caplog.records) == 1
    assert t.bytes_used == t.file_bytes(1000, k(2)) and t.get(k(2)) == payload(2)


def test_a_block_filed_under_another_key_is_refused(tmp_path):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    t.put(k(2), payload(2))
    os.replace(t.path_for(k(1)), t.path_for(k(2)))       # a copy under the wrong name
    assert t.get(k(2)) is None and t.counters.corrupt == 1


def test_a_file_removed_underneath_is_a_plain_miss(tmp_path):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    t.path_for(k(1)).unlink()
    assert t.get(k(1)) is None and k(1) not in t and t.bytes_used == 0
    assert t.counters.corrupt == 0 and t.counters.read_errors == 0


def test_open_removes_temp_files_of_writers_gone_and_keeps_a_live_ones(tmp_path):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    sub = t.path_for(k(1)).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone = sub / f".{k(1).hex()}.{int(dead.stdout)}.1.tmp"
    live = sub / f".{k(2).hex()}.{os.getpid()}.1.tmp"
    gone.write_bytes(b"partial")
    live.write_bytes(b"partial")
    again = tier(tmp_path)
    assert not gone.exists() and live.exists() and len(again) == 1


def test_files_it_did_not_write_are_ignored_at_open(tmp_path):
    t = tier(tmp_path)
    t.put(k(1), payload(1))
    sub = t.path_for(k(1)).parent
    strays = [sub / (k(1).hex()[:2] + "abc.kv"), sub / (k(1).hex()[:2].upper() + "ab.kv"), sub / "notes.kv",
              sub / "x.tmp", t.folder / "zz", t.folder / "readme.txt"]
    for s in strays:
        s.write_bytes(b"not a block")
    (sub / (k(1).hex()[:2] + "cd.kv")).mkdir()
    (sub / (k(1).hex()[:2] + "ef.kv")).symlink_to(t.path_for(k(1)))
    again = tier(tmp_path)
    assert len(again) == 1 and again.get(k(1)) == payload(1) and all(s.exists() for s in strays)
    assert again.clear() == 1 and all(s.exists() for s in strays)


def test_entries_folders_and_clear(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path, fp=OTHER_FP)
    for i in range(3):
        a.put(k(i), payload(i))
    b.put(k(9), payload(9, 500))
    mine = tmp_path / "notes.txt"
    mine.write_text("not the cache's")
    stray = a.folder / "README"
    stray.write_text("not the cache's either")
    assert {(f.name, f.files) for f in folders(tmp_path)} == {(FP.hex()[:16], 3), (OTHER_FP.hex()[:16], 1)}
    assert sorted(e[0] for e in a.entries()) == sorted(k(i) for i in range(3))
    assert all(size == block_bytes() and mtime > 0 for _, size, mtime in a.entries())
    assert a.clear() == 3 and len(a) == 0 and a.bytes_used == 0 and a.get(k(0)) is None
    assert stray.exists() and tier(tmp_path, fp=OTHER_FP).get(k(9)) == payload(9, 500)
    assert clear_root(tmp_path) == 1 and folders(tmp_path) == [FolderUsage(FP.hex()[:16], 0, 0)]   # README kept
    assert mine.exists() and not (tmp_path / OTHER_FP.hex()[:16]).exists()
    assert clear_root(tmp_path / "missing") == 0 and folders(tmp_path / "missing") == []


def test_a_root_that_cannot_be_a_folder_costs_the_cache_not_the_caller(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING, "twophase.cache.disk_tier"):
        t = tier(blocker)
        results = [t.put(k(i), payload(i)) for i in range(20)]
    assert results == [False] * 20 and t.counters.write_errors == 20 and t.get(k(1)) is None
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        DiskTier(tmp_path, -1, FP)
    with pytest.raises(ValueError, match="fingerprint"):
        DiskTier(tmp_path, 1, b"")
    with pytest.raises(ValueError, match="key"):
        tier(tmp_path).put(b"", b"x")
