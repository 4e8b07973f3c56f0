"""Where twophase keeps what it builds and fetches: ``$TWOPHASE_CACHE`` (default
``~/.cache/twophase``), one folder per kind (models, gguf, onnx, mlir, tensorrt, native,
calibration)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("TWOPHASE_CACHE") or os.path.join(Path.home(), ".cache", "twophase")
    return Path(root)


@contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """One builder of ``target`` at a time across processes (a server and a benchmark, or two
    test workers, on one cache): the second waits, then finds the first's build done. The lock
    is ``<target>.lock`` beside it (``filelock``: released if the holder dies)."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.with_name(target.name + ".lock")))
    try:
        lock.acquire(timeout=1)
    except TimeoutError:
        log.info("waiting for another process building %s", target.name)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
