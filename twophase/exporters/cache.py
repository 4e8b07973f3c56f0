"""Compiled artefacts (ONNX graphs, IREE modules, TensorRT engines) cached by a manifest.

A manifest is a small JSON dict naming everything the artefact was built from (model, weights'
hash, dtype, format version, tool versions, target). It keys the cache folder and is saved beside
the files with their sizes: a stale, half-written or truncated artefact is detected and rebuilt,
never silently reused. Builds go to a temporary folder that is renamed into place when complete.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twophase.contract import ModelSpec
from twophase.device import return_freed_memory
from twophase.paths import build_lock, cache_dir

log = logging.getLogger(__name__)


def weights_digest(model: ModelSpec) -> str:
    """sha256 of the weights' files, as the model's ``WeightSource`` names them: a GGUF file
    (with the version of the conversion that float loaders read it through), an HF folder's
    safetensors; for random weights, the seed. Remembered per file size and mtime (beside a
    folder's files, in the cache for a GGUF), so a second load does not re-read hundreds of MB."""
    source = model.source
    if source.kind == "random":
        return f"random:{source.seed}"
    assert source.path is not None
    if source.kind == "gguf":
        from twophase.models.gguf import CONVERSION

        where = hashlib.sha256(str(source.path.resolve()).encode()).hexdigest()[:16]
        memo = cache_dir() / "sha256" / f"{source.path.stem}-{where}.json"
        return f"gguf:{CONVERSION}:{_files_sha256([source.path], memo)}"
    return _files_sha256(sorted(source.path.glob("*.safetensors")), source.path / ".twophase-sha256.json")


def _files_sha256(files: list[Path], memo_path: Path) -> str:
    """sha256 over each file's sha256, those remembered in ``memo_path`` by name, size and mtime."""
    memo = json.loads(memo_path.read_text()) if memo_path.exists() else {}
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in memo:
            fh = hashlib.sha256()
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    fh.update(chunk)
            memo[key] = fh.hexdigest()
        h.update(memo[key].encode())
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        memo_path.write_text(json.dumps(memo))
    except OSError:           # a read-only model folder: hash again next time
        pass
    return h.hexdigest()


def cache_folder(kind: str, manifest: dict[str, Any]) -> Path:
    """``$TWOPHASE_CACHE/<kind>/<model>-<hash of the manifest>``."""

    key = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_dir() / kind / f"{manifest['model_id']}-{key}"


def is_fresh(folder: Path, manifest: dict[str, Any]) -> bool:
    """The artefact in ``folder`` was built from exactly ``manifest`` and is complete."""
    path = folder / "manifest.json"
    if not path.exists():
        return False
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    files = saved.pop("files", {})
    same = json.loads(json.dumps(manifest, default=str)) == saved
    return same and bool(files) and all(
        (folder / name).exists() and (folder / name).stat().st_size == size
        for name, size in files.items())


@contextmanager
def _spinner(text: str) -> Iterator[None]:
    """A line with the time elapsed while ``text`` runs, where stderr is a terminal (a cold
    export takes a minute or two and prints nothing else); elsewhere the log lines say it."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(text), TimeElapsedColumn(), transient=True,
                  console=Console(stderr=True)):
        yield


def build_cached(folder: Path, manifest: dict[str, Any], build: Callable[[Path], None],
                 force: bool = False, what: str = "artefact") -> Path:
    """``folder``, built by ``build(tmp_folder)`` unless an up-to-date build is already there."""
    if not force and is_fresh(folder, manifest):
        return folder
    with build_lock(folder):
        if not force and is_fresh(folder, manifest):        # built while this one waited
            return folder
        return _build(folder, manifest, build, what)


def _build(folder: Path, manifest: dict[str, Any], build: Callable[[Path], None], what: str) -> Path:
    if (folder / "manifest.json").exists():
        log.warning("%s in %s is stale or incomplete: rebuilding it", what, folder)
    log.info("building %s for %s in %s (once; later runs reuse it)", what,
             manifest["model_id"], folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    with _spinner(f"building {what} for {manifest['model_id']} (once)"):
        build(tmp)
    # a trace leaves copies of the weights in garbage and freed heap: hand them back now, or
    # they stay resident beside the runtime that loads the build (~1 GiB on Gemma 3 270M)
    gc.collect()
    return_freed_memory()
    log.info("built %s in %.0f s", what, time.perf_counter() - t0)
    manifest = dict(manifest, files={p.name: p.stat().st_size for p in tmp.iterdir()})
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
