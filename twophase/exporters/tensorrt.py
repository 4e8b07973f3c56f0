"""ONNX → a TensorRT engine with one optimisation profile a *rung*: prefill rungs, then decode
rungs, each over a narrower cached context with more rows (``twophase.exporters.trt_profiles``).

The engine is built from the ONNX step graph (``twophase.exporters.onnx``), so TensorRT computes
the same function as every other backend. TensorRT sizes each profile for all its maxima at
once; the rungs keep every tensor of the graph's attention within TensorRT's element limit and
the activations a few GiB, and the backend cuts each step into calls that fit them.

TensorRT 11 networks are strongly typed (the FP16/BF16 builder flags are gone): precision is the
exported graph's, i.e. ``model.dtype``. The engine is saved with a manifest naming the GPU, its
compute capability, the TensorRT version and the profile shapes; any difference rebuilds it. The
pool's block count is a dynamic dimension (its opt, the pool bound at build, is not in the
manifest), so a pool sized by the free memory of the day reuses the engine.

The builder times its kernels' tactics with a timing cache kept beside the engine cache, one
file a GPU, compute capability and TensorRT version (``timing_cache_path``): a second engine on
the same GPU (another pool's context width, another config) reuses the first one's timings
instead of measuring every tactic again.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from twophase.contract import EngineLimits, ModelSpec
from twophase.errors import BackendUnavailable, TwophaseError, install_hint
from twophase.exporters.trt_profiles import WORKSPACE_BYTES, Profile, cache_key, profile_shapes

__all__ = ["EngineMismatch", "build_engine", "export", "import_tensorrt", "profile_shapes",
           "require_export_packages"]
# 2: a ladder of profiles (rungs) and a dynamic pool block count; 3: the pool within TensorRT's
# element limit, its kernels tuned for the pool bound (not part of the key); 4: experts (MOE_FORM)
FORMAT = "twophase-tensorrt/4"
# experts in standard ONNX ops (TensorRT's parser reads no ``com.microsoft`` operator): every
# expert on every token, weighted by the routing (``models/layers/moe_graph.py: dense``)
MOE_FORM = "dense"
# what the engine is built from: the ONNX export (onnx, and onnxscript for torch's dynamo exporter)
EXPORT_PACKAGES = ("onnx", "onnxscript")
log = logging.getLogger(__name__)


class EngineMismatch(TwophaseError):
    """A serialised engine built for another GPU, TensorRT version or set of shapes."""


def gpu_identity(device_index: int = 0) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}"}


def manifest_for(model: ModelSpec, profiles: list[Profile], trt_version: str,
                 gpu: dict[str, Any], onnx_manifest: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "model_id": model.model_id, "tensorrt": trt_version, **gpu,
            "profiles": cache_key(profiles),
            "onnx": {k: onnx_manifest[k] for k in ("format", "weights_sha256", "dtype", "opset")}}


def check_manifest(folder: Path, expected: dict[str, Any]) -> None:
    """Refuse an engine in a folder the user named whose build does not match this machine."""
    path = folder / "manifest.json"
    if not path.exists():
        raise EngineMismatch(f"{folder} holds no manifest.json: not a twophase TensorRT engine")
    saved = json.loads(path.read_text())
    for key, what in (("gpu", "GPU"), ("compute_capability", "compute capability"),
                      ("tensorrt", "TensorRT version"), ("onnx", "model export"),
                      ("profiles", "profile shapes")):
        if saved.get(key) != json.loads(json.dumps(expected[key])):
            mine = expected[key] if key != "profiles" else "this config's"
            theirs = saved.get(key) if key != "profiles" else "other"
            raise EngineMismatch(f"the engine in {folder} was built for {what} {theirs}, not "
                                 f"{mine}: delete it or build again with "
                                 f"`twophase export --format tensorrt --force`")


def timing_cache_path(gpu: dict[str, Any], trt_version: str) -> Path:
    """The builder's timing cache for this GPU and TensorRT version, beside the engine cache."""
    from twophase.paths import cache_dir

    name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{gpu['gpu']}-sm{gpu['compute_capability']}-trt{trt_version}")
    return cache_dir() / "tensorrt" / f"timing-{name}.cache"


def build_engine(trt, onnx_path: Path, profiles: list[Profile], out: Path,
                 timing_cache: Path | None = None) -> None:
    """Parse the ONNX graph into a strongly typed network and build one engine with
    ``profiles`` in order (profile ``i`` is rung ``i``), its tactics timed through
    ``timing_cache`` (read if it is there, written back after the build)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network()                # strongly typed: no precision flags
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):    # reads the external weights beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TwophaseError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if timing_cache is not None:
        _use_timing_cache(config, timing_cache)
    for index, shapes in enumerate(profiles):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        got = config.add_optimization_profile(profile)
        if got != index:
            raise TwophaseError(f"TensorRT numbered profile {index} as {got}")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TwophaseError("TensorRT failed to build the engine (see its log above)")
    out.write_bytes(bytes(serialized))
    if timing_cache is not None:
        _save_timing_cache(config, timing_cache)


def _use_timing_cache(config, path: Path) -> None:
    """Give the builder the timings saved at ``path`` (an empty cache where there are none, or
    where TensorRT refuses them: the build then times every tactic)."""
    saved = path.read_bytes() if path.exists() else b""
    try:
        cache = config.create_timing_cache(saved)
        if config.set_timing_cache(cache, False):
            log.info("TensorRT timing cache: %s (%d bytes)", path, len(saved))
            return
        log.warning("TensorRT refused the timing cache %s: timing every tactic", path)
    except Exception as exc:          # a corrupt or foreign cache: the bindings raise
        log.warning("TensorRT could not read the timing cache %s (%s): timing every tactic", path, exc)
    config.set_timing_cache(config.create_timing_cache(b""), False)


def _save_timing_cache(config, path: Path) -> None:
    """The builder's timings (the saved ones and this build's) written back, whole or not at all."""
    try:
        data = bytes(config.get_timing_cache().serialize())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)                    # atomic: a concurrent build reads old or new
    except Exception as exc:                 # the engine is built: a cache not kept costs time only
        log.warning("could not save the TensorRT timing cache to %s: %s", path, exc)


def export(model: ModelSpec, limits: EngineLimits, block_size: int, num_blocks: int,
           out_dir: Path | None = None, force: bool = False, device_index: int = 0,
           slots: int | None = None) -> Path:
    """The engine for ``model`` on this GPU (``model.engine`` + ``manifest.json``), built now
    unless an up-to-date one is in the cache. A folder the user names (``out_dir``) is used as
    it is if it holds an engine, and refused if that engine was built for something else."""
    from twophase.exporters import onnx
    from twophase.exporters.cache import build_cached, cache_folder, is_fresh

    trt = import_tensorrt()
    require_export_packages()
    profiles = profile_shapes(model.arch, limits, block_size, num_blocks, slots)
    onnx_manifest = onnx.manifest_for(model, MOE_FORM)
    gpu = gpu_identity(device_index)
    manifest = manifest_for(model, profiles, trt.__version__, gpu, onnx_manifest)
    if out_dir and (Path(out_dir) / "model.engine").exists() and not force:
        check_manifest(Path(out_dir), manifest)
        if is_fresh(Path(out_dir), manifest):
            return Path(out_dir) / "model.engine"
    folder = Path(out_dir) if out_dir else cache_folder("tensorrt", manifest)

    def build(tmp: Path) -> None:
        graph = onnx.export(model, moe_form=MOE_FORM)
        log.info("building a TensorRT engine for %s (%d profiles): minutes", model.model_id,
                 len(profiles))
        build_engine(trt, graph, profiles, tmp / "model.engine", timing_cache_path(gpu, trt.__version__))

    build_cached(folder, manifest, build, force, "TensorRT engine")
    return folder / "model.engine"


def require_export_packages() -> None:
    """Refuse, naming them and the extra that installs them, the packages the engine's ONNX
    export needs (before anything is allocated, not as an ImportError halfway through bind)."""
    missing = [name for name in EXPORT_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailable(f"the tensorrt backend builds its engine from the model's ONNX "
                                 f"export, which needs {' and '.join(missing)}: {install_hint('tensorrt')} "
                                 f"(or pip install {' '.join(missing)})")


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailable(f"TensorRT is not installed: {install_hint('tensorrt')} "
                                 f"(NVIDIA's wheel, with its CUDA libraries)") from None
    return tensorrt
