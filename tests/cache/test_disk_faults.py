"""The disk tier when the disk misbehaves: a writer killed mid-write, a full filesystem, a
read-only one. Full and read-only use a small tmpfs mounted for the test (needs root, or the
permission to mount: skipped otherwise)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import twophase
from twophase.cache.disk_tier import DiskTier

FP = hashlib.sha256(b"model a").digest()
LOGGER = "twophase.cache.disk_tier"


def k(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def payload(i: int, size: int) -> bytes:
    return (hashlib.sha256(b"payload %d" % i).digest() * (size // 32 + 1))[:size]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:        # no mount(8) here, or it hangs
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at ``tmp_path / "mnt"``, unmounted after the test."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if sys.platform != "linux":
        pytest.skip("mounts a tmpfs: Linux only")
    done = _run("mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt))
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({(done.stderr or done.stdout).strip() or done.returncode})")
    try:
        yield mnt
    finally:
        if _run("umount", str(mnt)).returncode:
            _run("umount", "-l", str(mnt))


def _read_only(mnt: Path) -> None:
    done = _run("mount", "-o", "remount,ro", str(mnt))
    if done.returncode:
        pytest.skip(f"cannot remount a tmpfs read-only here ({done.stderr.strip() or done.returncode})")


WRITER = textwrap.dedent("""
    import hashlib, sys
    from twophase.cache.disk_tier import DiskTier
    t = DiskTier(sys.argv[1], 1 << 30, hashlib.sha256(b"model a").digest(), fsync=True)
    size = int(sys.argv[2])
    i = 0
    while True:
        data = (hashlib.sha256(b"payload %d" % i).digest() * (size // 32 + 1))[:size]
        t.put(hashlib.sha256(i.to_bytes(8, "big")).digest(), data)
        i += 1
""")


def _same_twophase() -> dict[str, str]:
    """The environment of a child that imports the twophase this test imported."""
    src = str(Path(twophase.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _kill_mid_write(root: Path, size: int) -> list[Path]:
    """Start a writer of ``size``-byte blocks and SIGKILL it once it has written a few, as soon as
    a temp file exists (or after 2 s); the temp files it left. Tried again if a kill lands between
    two blocks: the caller checks that one try caught a write under way."""
    left: list[Path] = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(size)], env=_same_twophase())
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(list(root.rglob("*.kv"))) < 3:
                time.sleep(0.005)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not list(root.rglob("*.tmp")):
                pass
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        left = list(root.rglob("*.tmp"))
        if left:
            break
    return left


def test_a_writer_killed_mid_write_leaves_only_whole_blocks(tmp_path):
    left = _kill_mid_write(tmp_path, 4 << 20)
    t = DiskTier(tmp_path, 1 << 30, FP)
    assert len(t) >= 3
    for key, size, _ in t.entries():
        got = t.get(key)
        assert got is not None and size == t.file_bytes(4 << 20, key)
        i = next(i for i in range(1000) if k(i) == key)
        assert got == payload(i, 4 << 20)
    assert t.counters.corrupt == 0 and t.counters.misses == 0
    assert left, "the writer was never caught mid-write"
    assert not any(p.exists() for p in left) and not list(tmp_path.rglob("*.tmp"))
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == t.bytes_used


def test_a_full_disk_costs_old_blocks_and_never_raises(small_fs, caplog):
    """The limit (10 MiB) is far above the disk (256 KiB): the disk fills first, and each later
    put makes room by giving up the tier's own oldest blocks."""
    t = DiskTier(small_fs, 10 << 20, FP)
    size = 20 << 10
    with caplog.at_level(logging.WARNING, LOGGER):
        results = [t.put(k(i), payload(i, size)) for i in range(40)]
    assert all(results[:8]) and results[-1] and sum(results) >= 30
    assert t.counters.evicted > 0 and t.bytes_used <= 256 << 10       # room made from its own blocks
    assert not list(small_fs.rglob("*.tmp"))
    for key, _, _ in t.entries():
        assert t.get(key) is not None
    assert t.get(k(39)) == payload(39, size) and t.counters.corrupt == 0
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) <= 1


def test_a_disk_full_of_others_files_warns_once_and_recovers(small_fs, caplog):
    filler = small_fs / "someone-elses"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    t = DiskTier(small_fs, 10 << 20, FP)
    with caplog.at_level(logging.INFO, LOGGER):
        results = [t.put(k(i), payload(i, 20 << 10)) for i in range(30)]
        assert results == [False] * 30 and t.counters.write_errors == 30 and len(t) == 0
        assert t.get(k(1)) is None and not list(small_fs.rglob("*.tmp"))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "ENOSPC" in warnings[0].getMessage()
        filler.unlink()                             # the disk frees up: writes resume
        assert t.put(k(100), payload(100, 20 << 10)) and t.get(k(100)) == payload(100, 20 << 10)
    assert any("succeed again" in r.getMessage() for r in caplog.records)


def test_a_read_only_disk_serves_its_blocks_and_refuses_writes_quietly(small_fs, caplog):
    size = 10 << 10
    t = DiskTier(small_fs, 1 << 20, FP)
    for i in range(4):
        assert t.put(k(i), payload(i, size))
    bad = t.path_for(k(3))
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 1
    bad.write_bytes(bytes(raw))
    _read_only(small_fs)
    ro = DiskTier(small_fs, 1 << 20, FP)
    assert len(ro) == 4
    with caplog.at_level(logging.WARNING, LOGGER):
        assert ro.get(k(0)) == payload(0, size)             # the mtime cannot be refreshed: still a hit
        assert [ro.put(k(i), payload(i, size)) for i in range(10, 30)] == [False] * 20
        assert ro.get(k(3)) is None and ro.counters.corrupt == 1 and k(3) not in ro
    assert ro.counters.write_errors == 20
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert "EROFS" in next(r.getMessage() for r in caplog.records if "cannot write" in r.getMessage())
    assert bad.exists()                                     # could not be removed; no exception either
