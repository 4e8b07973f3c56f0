"""The disk tier: K/V blocks as files, bounded by bytes, least recently used removed first, kept
across restarts for the same fingerprint.

Layout: ``<root>/<fingerprint hex[:16]>/<key hex[:2]>/<key hex>.kv``; a file is a header then the
payload. The header (little-endian, ``_HEAD`` then the full fingerprint and the full key):

    magic b"TPKVBLK\\0" | version u16 | fingerprint length u8 | key length u8 |
    payload length u64 | crc32 u32 | fingerprint | key | payload

The checksum is ``zlib.crc32`` over the header (its crc field left out), the fingerprint, the key
and the payload. It guards against accidental damage (bit rot, a file cut short, a partial copy):
crc32 finds every burst of up to 32 flipped bits and misses other damage once in 2**32, and it
ran at 1.7 GB/s on an x86 core with AVX2 where ``blake2b`` ran at 0.4 GB/s, slower than reading a
block back from the page cache. A cryptographic hash would buy nothing: whoever can write this folder
can write a valid file anyway. Which block and which model a file holds is checked exactly, by
comparing the key and fingerprint stored in the header, not through the checksum.

Crash safety: a block is written to a temporary file in its final folder, flushed and fsynced,
then renamed over its final name (``os.replace``, atomic within a filesystem) and the folder
fsynced. A reader therefore sees a whole file or none: a writer killed mid-write leaves only a
temporary file (``.<key>.<pid>.<n>.tmp``), which a later open removes once its writer is gone. A
file damaged anyway (a disk error, a hand edit) fails the header or checksum check, is removed and
reads as a miss.

Errors cost the cache, never the caller: an OS error (full disk, read-only filesystem, no
permission, a folder removed underneath) makes ``put`` return False and ``get`` return None, with
one warning per five minutes at most. Writes are retried on later puts, so a disk that frees up is
used again.

One process a folder keeps the byte limit exact; several sharing one are safe (each file is
written whole, a file gone underneath is a miss) but each counts only its own writes.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"TPKVBLK\x00"
VERSION = 1
_HEAD = struct.Struct("<8sHBBQI")     # magic, version, fingerprint len, key len, payload len, crc32
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0                 # a temp file this old is removed even if its pid runs
WARN_INTERVAL_S = 300.0
_HEX = frozenset("0123456789abcdef")


@dataclass
class DiskCounters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0      # file bytes written (header and payload)
    bytes_read: int = 0         # payload bytes served
    corrupt: int = 0            # files that failed a check, removed
    write_errors: int = 0       # puts an OS error refused
    read_errors: int = 0        # gets an OS error other than "gone" refused
    evicted: int = 0            # files removed for the byte limit


@dataclass(frozen=True)
class FolderUsage:
    """One fingerprint's folder under a root: what ``twophase cache`` lists."""

    name: str                   # the fingerprint's first 16 hex digits
    files: int
    bytes: int


class _Throttle:
    """One warning per interval, so a full disk logs once rather than once a block."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last: float | None = None
        self.suppressed = 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval_s:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last warning)" if self.suppressed else ""
        log.warning("%s%s; further ones at most every %.0f s", message, more, self.interval_s)
        self.last, self.suppressed = now, 0


class DiskTier:
    """Blocks of one fingerprint under ``root_dir``, at most ``max_bytes`` of files.

    An in-memory index (key -> file bytes, least recently used first) answers ``in`` and a miss
    without touching the filesystem; it is rebuilt from the folder at open, ordered by mtime,
    which each read refreshes (``os.utime``) so recency survives a restart. Not thread-safe: one
    caller at a time (a background writer thread owns it alone)."""

    def __init__(self, root_dir: str | os.PathLike[str], max_bytes: int, fingerprint: bytes, fsync: bool = True):
        if max_bytes < 0:
            raise ValueError(f"DiskTier: max_bytes must be >= 0, got {max_bytes}")
        if not 1 <= len(fingerprint) <= 255:
            raise ValueError(f"DiskTier: a fingerprint is 1 to 255 bytes, got {len(fingerprint)}")
        self.root = Path(os.path.expanduser(os.fspath(root_dir)))
        self.folder = self.root / fingerprint.hex()[:16]
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.counters = DiskCounters()
        self._index: OrderedDict[bytes, tuple[int, float]] = OrderedDict()   # key -> (bytes, mtime)
        self._bytes = 0
        self._tmp_serial = 0
        self._write_warn = _Throttle(WARN_INTERVAL_S)
        self._read_warn = _Throttle(WARN_INTERVAL_S)
        self._writes_failing = False
        self._load_index()

    # -- the index ---------------------------------------------------------------------------------

    def _load_index(self) -> None:
        """Learn what a previous run left: every block file (by mtime, oldest first) and its bytes;
        temporary files of writers no longer running are removed."""
        found: list[tuple[float, bytes, int]] = []
        try:
            for path, st in _block_files(self.folder, remove_stale_tmp=True):
                found.append((st.st_mtime, bytes.fromhex(path.name[:-len(_SUFFIX)]), st.st_size))
        except OSError as exc:
            self._read_warn.warn(f"disk KV cache {self.folder}: cannot read its folder ({_reason(exc)}); "
                                 f"starting empty")
        found.sort(key=lambda t: t[0])
        for mtime, key, size in found:
            self._index[key] = (size, mtime)
            self._bytes += size
        self._evict_to(self.max_bytes)          # the limit may have been lowered since

    def _evict_to(self, limit: int) -> None:
        """Remove the least recently used files until at most ``limit`` bytes remain."""
        while self._index and self._bytes > limit:
            key, (size, _) = self._index.popitem(last=False)
            self._bytes -= size
            self.counters.evicted += 1
            _unlink(self.path_for(key))

    def _forget(self, key: bytes) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes -= entry[0]

    # -- blocks ------------------------------------------------------------------------------------

    def path_for(self, key: bytes) -> Path:
        h = key.hex()
        return self.folder / h[:2] / (h + _SUFFIX)

    def file_bytes(self, payload_len: int, key: bytes) -> int:
        """The bytes a block's file takes: what ``max_bytes`` counts."""
        return _HEAD.size + len(self.fingerprint) + len(key) + payload_len

    def put(self, key: bytes, payload: bytes) -> bool:
        """Write a block; True if it is on disk now. A block already here is only marked recently
        used. False, never an exception, when it cannot be kept: larger than ``max_bytes``, or an
        OS error (counted in ``write_errors`` and logged, throttled)."""
        if not 1 <= len(key) <= 255:
            raise ValueError(f"DiskTier: a key is 1 to 255 bytes, got {len(key)}")
        if key in self._index:
            self._touch(key)
            return True
        size = self.file_bytes(len(payload), key)
        if size > self.max_bytes:
            return False
        self._evict_to(self.max_bytes - size)
        try:
            self._write(key, payload)
        except OSError as exc:
            if not (exc.errno == errno.ENOSPC and self._index and self._retry_after_room(key, payload, size)):
                self._write_failed(exc)
                return False
        self._index[key] = (size, time.time())
        self._bytes += size
        self.counters.bytes_written += size
        if self._writes_failing:
            self._writes_failing = False
            log.info("disk KV cache %s: writes succeed again", self.folder)
        return True

    def _retry_after_room(self, key: bytes, payload: bytes, size: int) -> bool:
        """The disk filled before our limit did (other files share it): give up our oldest blocks
        to make room for this one and try once more."""
        self._evict_to(max(0, self._bytes - size))
        try:
            self._write(key, payload)
        except OSError:
            return False
        return True

    def _write_failed(self, exc: OSError) -> None:
        self.counters.write_errors += 1
        self._writes_failing = True
        self._write_warn.warn(f"disk KV cache {self.folder}: cannot write a block ({_reason(exc)}); "
                              f"blocks it cannot write are dropped, writes are retried later")

    def _write(self, key: bytes, payload: bytes) -> None:
        """Temp file in the final folder, fsync, atomic rename, fsync the folder: whole or absent."""
        final = self.path_for(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_serial += 1
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{self._tmp_serial}{_TMP_SUFFIX}"
        fields = (MAGIC, VERSION, len(self.fingerprint), len(key), len(payload))
        crc = zlib.crc32(payload, zlib.crc32(key, zlib.crc32(self.fingerprint, zlib.crc32(_head_fields(*fields)))))
        head = _HEAD.pack(*fields, crc) + self.fingerprint + key
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, head)
                _write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(final.parent)

    def get(self, key: bytes) -> bytes | None:
        """The block's payload, now the most recently used; None on a miss. A file that fails a
        check is removed and counted in ``corrupt``; an OS error is a miss too."""
        if key not in self._index:
            self.counters.misses += 1
            return None
        path = self.path_for(key)
        try:
            payload = self._read(path, key)
        except OSError as exc:
            self._forget(key)
            self.counters.misses += 1
            if exc.errno != errno.ENOENT:       # gone (cleared by another process) is a plain miss
                self.counters.read_errors += 1
                self._read_warn.warn(f"disk KV cache {self.folder}: cannot read a block ({_reason(exc)})")
            return None
        if payload is None:
            self._forget(key)
            _unlink(path)
            self.counters.corrupt += 1
            self.counters.misses += 1
            self._read_warn.warn(f"disk KV cache {self.folder}: {path.name} failed its check, removed")
            return None
        self._touch(key)
        self.counters.hits += 1
        self.counters.bytes_read += len(payload)
        return payload

    def _read(self, path: Path, key: bytes) -> bytes | None:
        """The verified payload, or None if the file is not a whole, intact block of ``key``."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(_HEAD.size)
            if len(raw) < _HEAD.size:
                return None
            magic, version, fp_len, key_len, payload_len, crc = _HEAD.unpack(raw)
            if (magic, version, fp_len, key_len) != (MAGIC, VERSION, len(self.fingerprint), len(key)):
                return None
            if size != _HEAD.size + fp_len + key_len + payload_len:
                return None
            ident = f.read(fp_len + key_len)
            if ident != self.fingerprint + key:
                return None
            payload = f.read(payload_len)
        if len(payload) != payload_len:
            return None
        expect = zlib.crc32(payload, zlib.crc32(ident, zlib.crc32(raw[:-4])))
        return payload if expect == crc else None

    def _touch(self, key: bytes) -> None:
        """Most recently used, in the index and in the file's mtime (what a restart orders by)."""
        size, mtime = self._index[key]
        try:
            os.utime(self.path_for(key))
            mtime = time.time()
        except OSError:
            pass                                # a read-only disk keeps the old order; still a hit
        self._index[key] = (size, mtime)
        self._index.move_to_end(key)

    # -- listing and clearing (``twophase cache``) --------------------------------------------------

    def entries(self) -> list[tuple[bytes, int, float]]:
        """``(key, file bytes, mtime)`` of every block, least recently used first."""
        return [(k, size, mtime) for k, (size, mtime) in self._index.items()]

    def clear(self) -> int:
        """Remove every block of this fingerprint (those other processes wrote too); the number
        of files removed."""
        removed = clear_root(self.root, self.folder.name)
        self._index.clear()
        self._bytes = 0
        return removed

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._bytes


def folders(root_dir: str | os.PathLike[str]) -> list[FolderUsage]:
    """Every fingerprint's folder under ``root_dir`` with its block files and bytes."""
    root = Path(os.path.expanduser(os.fspath(root_dir)))
    out = []
    for folder in _fingerprint_folders(root):
        try:
            files = [st.st_size for _, st in _block_files(folder)]
        except OSError:
            continue                            # a folder that cannot be listed: none of ours to show
        out.append(FolderUsage(folder.name, len(files), sum(files)))
    return out


def clear_root(root_dir: str | os.PathLike[str], name: str | None = None) -> int:
    """Remove the block files of one fingerprint's folder (``name``: its 16 hex digits) or of all,
    and the folders they leave empty; the number of block files removed. Only files this module
    writes are touched, so a root pointed at a folder holding anything else keeps it."""
    root = Path(os.path.expanduser(os.fspath(root_dir)))
    removed = 0
    for folder in _fingerprint_folders(root):
        if name is not None and folder.name != name:
            continue
        try:
            paths = [path for path, _ in _block_files(folder, remove_stale_tmp=True)]
        except OSError:
            paths = []
        removed += sum(_unlink(path) for path in paths)
        try:
            subs = list(folder.iterdir())
        except OSError:
            subs = []
        for sub in subs + [folder]:
            try:
                sub.rmdir()                     # only if empty
            except OSError:
                pass
    return removed


def _fingerprint_folders(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if _is_hex(p.name, 16) and p.is_dir())
    except OSError:
        return []


def _block_files(folder: Path, remove_stale_tmp: bool = False) -> Iterator[tuple[Path, os.stat_result]]:
    """Every block file under a fingerprint's folder, with its stat. Raises OSError only if the
    folder exists but cannot be listed."""
    try:
        subs = [e for e in os.scandir(folder) if _is_hex(e.name, 2) and e.is_dir()]
    except FileNotFoundError:
        return
    for sub in subs:
        try:
            names = list(os.scandir(sub.path))
        except OSError:
            continue
        for e in names:
            if e.name.endswith(_TMP_SUFFIX) and remove_stale_tmp:
                _remove_if_abandoned(Path(e.path))
            elif e.name.endswith(_SUFFIX) and _is_hex(e.name[:-len(_SUFFIX)]) and e.name.startswith(sub.name):
                try:
                    if e.is_file(follow_symlinks=False):    # never a folder or a link to elsewhere
                        yield Path(e.path), e.stat(follow_symlinks=False)
                except OSError:
                    continue


def _remove_if_abandoned(path: Path) -> None:
    """A temp file whose writer is gone (killed mid-write) or that is an hour old."""
    parts = path.name.split(".")            # "", key hex, pid, serial, "tmp"
    try:
        pid = int(parts[2])
        stale = time.time() - path.stat().st_mtime > _STALE_TMP_S
    except (IndexError, ValueError, OSError):
        return
    if stale or not _pid_running(pid):
        _unlink(path)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                         # someone else's process
    return True


def _head_fields(magic: bytes, version: int, fp_len: int, key_len: int, payload_len: int) -> bytes:
    return _HEAD.pack(magic, version, fp_len, key_len, payload_len, 0)[:-4]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; not every platform or filesystem can open a folder, which only
    weakens durability against power loss, not atomicity."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> int:
    try:
        path.unlink()
    except OSError:
        return 0
    return 1


def _is_hex(name: str, length: int | None = None) -> bool:
    """Lower-case hex of whole bytes (what ``bytes.hex`` writes), of ``length`` digits if given."""
    return bool(name) and len(name) % 2 == 0 and (length is None or len(name) == length) and set(name) <= _HEX


def _reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    return f"{name}: {exc.strerror}" if name and exc.strerror else str(exc)
