"""What ``$TWOPHASE_CACHE`` holds, by kind, with sizes; and clearing kinds of it.

Everything in the cache is rebuilt on demand (downloads fetched again, models converted again,
graphs exported again), so clearing only costs the time to rebuild.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = {
    "gguf": "downloaded GGUF files",
    "models": "models converted to HF folders",
    "onnx": "ONNX exports (onnxruntime)",
    "mlir": "compiled IREE modules",
    "tensorrt": "TensorRT engines",
    "native": "4-bit weights and the compiled kernel (native)",
    "routing": "backend auto's timings per model and machine",
    "calibration.json": "device ceilings (twophase calibrate)",
}


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str            # the entry's path under its kind ("" for a kind that is one file)
    bytes: int
    modified: float      # seconds since the epoch
    complete: bool       # False: a build that never finished (a ``.tmp`` folder)


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def entries(root: Path) -> list[Entry]:
    """Every entry of every kind under ``root``, largest first."""
    out = []
    for kind in KINDS:
        path = root / kind
        if path.is_file():
            out.append(Entry(kind, "", size_of(path), path.stat().st_mtime, True))
        elif path.is_dir():
            out += [Entry(kind, p.name, size_of(p), p.stat().st_mtime, not p.name.endswith(".tmp"))
                    for p in path.iterdir() if p.suffix != ".lock"]     # a build's lock file
    return sorted(out, key=lambda e: -e.bytes)


def unknown(root: Path) -> list[str]:
    """Names under ``root`` that are no kind of ours (left alone by ``clear``)."""
    return sorted(p.name for p in root.iterdir() if p.name not in KINDS) if root.is_dir() else []


def clear(root: Path, kinds: list[str]) -> int:
    """Delete ``kinds`` (names of ``KINDS``) under ``root``; returns the bytes freed."""
    freed = 0
    for kind in kinds:
        path = root / kind
        if not path.exists():
            continue
        freed += size_of(path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return freed


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def age(modified: float, now: float | None = None) -> str:
    s = (time.time() if now is None else now) - modified
    for unit, secs in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= secs:
            return f"{s / secs:.0f} {unit} ago"
    return "just now"
