"""ONNX → a TensorRT engine with one optimisation profile a *rung*: prefill rungs, then decode
rungs, each over a narrower cached context with more rows (``twophase.exporters.trt_profiles``).

The engine is built from the ONNX step graph (``twophase.exporters.onnx``), so TensorRT computes
the same function as every other backend. TensorRT sizes each profile for all its maxima at
once; the rungs keep every tensor of the graph's attention within TensorRT's element limit and
the activations a few GiB, and the backend cuts each step into calls that fit them.

TensorRT 11 networks are strongly typed (the FP16/BF16 builder flags are gone): precision is the
exported graph's, i.e. ``model.dtype``. The engine is saved with a manifest naming the GPU, its
compute capability, the TensorRT version and the profile shapes; any difference rebuilds it. The
pool's block count is a dynamic dimension, so a pool sized by the free memory of the day reuses
the engine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from twophase.contract import EngineLimits, ModelSpec
from twophase.errors import BackendUnavailable, TwophaseError
from twophase.exporters.trt_profiles import WORKSPACE_BYTES, Profile, profile_shapes

__all__ = ["EngineMismatch", "build_engine", "export", "import_tensorrt", "profile_shapes"]
# 2: a ladder of profiles (rungs) and a dynamic pool block count
FORMAT = "twophase-tensorrt/2"
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
            "profiles": [{n: [list(s) for s in mmo] for n, mmo in p.items()} for p in profiles],
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


def build_engine(trt, onnx_path: Path, profiles: list[Profile], out: Path) -> None:
    """Parse the ONNX graph into a strongly typed network and build one engine with
    ``profiles`` in order (profile ``i`` is rung ``i``)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network()                # strongly typed: no precision flags
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):    # reads the external weights beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TwophaseError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
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


def export(model: ModelSpec, limits: EngineLimits, block_size: int, num_blocks: int,
           out_dir: Path | None = None, force: bool = False, device_index: int = 0) -> Path:
    """The engine for ``model`` on this GPU (``model.engine`` + ``manifest.json``), built now
    unless an up-to-date one is in the cache. A folder the user names (``out_dir``) is used as
    it is if it holds an engine, and refused if that engine was built for something else."""
    from twophase.exporters import onnx
    from twophase.exporters.cache import build_cached, cache_folder, is_fresh

    trt = import_tensorrt()
    profiles = profile_shapes(model.arch, limits, block_size, num_blocks)
    onnx_manifest = onnx.manifest_for(model)
    manifest = manifest_for(model, profiles, trt.__version__, gpu_identity(device_index),
                            onnx_manifest)
    if out_dir and (Path(out_dir) / "model.engine").exists() and not force:
        check_manifest(Path(out_dir), manifest)
        if is_fresh(Path(out_dir), manifest):
            return Path(out_dir) / "model.engine"
    folder = Path(out_dir) if out_dir else cache_folder("tensorrt", manifest)

    def build(tmp: Path) -> None:
        graph = onnx.export(model)
        log.info("building a TensorRT engine for %s (%d profiles): minutes", model.model_id,
                 len(profiles))
        build_engine(trt, graph, profiles, tmp / "model.engine")

    build_cached(folder, manifest, build, force, "TensorRT engine")
    return folder / "model.engine"


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailable("TensorRT is not installed: pip install 'twophase[tensorrt]' "
                                 "(NVIDIA's wheel, with its CUDA libraries)") from None
    return tensorrt
