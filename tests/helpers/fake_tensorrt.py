"""A recording stand-in for the ``tensorrt`` module (TensorRT 11's Python API), for machines
without TensorRT or a GPU.

It implements exactly the methods twophase calls, with their real signatures, records each call,
and enforces what TensorRT enforces:

- a new execution context starts on profile 0 and runs the profile it last selected (selecting
  one the engine lacks raises, as TensorRT's bindings do where the C++ call returns false);
  every input's shape must lie within that profile; every I/O tensor needs a 256-byte aligned
  address; outputs have the shapes the engine infers from the inputs set (``get_tensor_shape``)
  and the graph's dtypes (``get_tensor_dtype``);
- no tensor the engine computes may hold more than 2^31 - 1 elements (the builder fails): the
  I/O tensors at each profile's maxima, the KV pool among them (a TensorRT maintainer: the limit
  is not configurable, as many kernels address offsets in 32 bits; nothing documents an
  exemption for a Gather's source), and the step graph's attention and MLP intermediates;
- the builder reads and extends a timing cache it is given (``create_timing_cache``,
  ``set_timing_cache``): a profile's tactics timed once are not timed again;
- an engine's activation memory is sized for each profile's maxima at once; a ``STATIC`` context
  allocates the largest profile's from ``DEVICE_MEMORY`` (creation fails when it is spent), a
  ``USER_MANAGED`` one runs only once given a large enough, aligned buffer;
- I/O tensors have the graph's dtypes: float32, float16 or bfloat16 float data, int64 indices.

Its "engine" is the ONNX graph the parser read, run by ONNX Runtime on the CPU, reading and
writing the bound host addresses, so a backend driven through it computes real tokens. Its
activation figures are its own estimate from the graph's weights and the profile maxima,
independent of twophase's.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

try:                                       # bfloat16 arrays (onnx depends on it; a bare GPU box may lack it)
    import ml_dtypes
except ImportError:
    ml_dtypes = None

__version__ = "11.0.0-standin"
calls: list[tuple] = []                    # (method, args...) in call order
ELEMENT_LIMIT = 2**31 - 1
ALIGNMENT = 256
DEVICE_MEMORY = 141 * 10**9                # an H200's: tests lower it
allocated = [0]                            # bytes STATIC contexts hold


def _record(*call):
    calls.append(call)


class Logger:
    WARNING = 2

    def __init__(self, min_severity=WARNING):
        _record("Logger", min_severity)


class MemoryPoolType:
    WORKSPACE = "WORKSPACE"


class DataType:
    FLOAT = "FLOAT"
    HALF = "HALF"
    BF16 = "BF16"
    INT32 = "INT32"
    INT64 = "INT64"


_TRT_TYPES = {"tensor(float)": DataType.FLOAT, "tensor(float16)": DataType.HALF,
              "tensor(bfloat16)": DataType.BF16, "tensor(int64)": DataType.INT64,
              "tensor(int32)": DataType.INT32}
TIMING_DEVICE = "Stand-in GPU"             # whose timings a cache holds: another's is a mismatch


class ITimingCache:
    def __init__(self, entries: dict, device: str = TIMING_DEVICE):
        self.entries, self.device = entries, device

    def serialize(self) -> memoryview:           # TensorRT returns an IHostMemory (a buffer)
        return memoryview(json.dumps({"device": self.device, "entries": self.entries}).encode())


class ExecutionContextAllocationStrategy:
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class INetworkDefinition:
    pass


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Logger):
        self.network = network
        self.num_errors = 0

    def parse_from_file(self, model: str) -> bool:
        """As TensorRT's parser: standard ONNX operators only (no ``com.microsoft`` ones, which
        are ONNX Runtime's), else False with an error a node."""
        import onnx

        _record("OnnxParser.parse_from_file", model)
        graph = onnx.load(model, load_external_data=False).graph
        self.errors = [f"no importer for {n.domain}::{n.op_type}" for n in graph.node
                       if n.domain not in ("", "ai.onnx")]
        self.num_errors = len(self.errors)
        self.network.onnx_path = model
        return not self.errors

    def get_error(self, index: int):
        if index >= self.num_errors:
            raise IndexError(index)
        return self.errors[index]


class IOptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, input: str, min, opt, max) -> None:   # noqa: A002 (TensorRT's names)
        assert all(a <= b <= c for a, b, c in zip(min, opt, max)), (input, min, opt, max)
        self.shapes[input] = [list(min), list(opt), list(max)]


class IBuilderConfig:
    def __init__(self):
        self.profiles: list[IOptimizationProfile] = []
        self.timing_cache: ITimingCache | None = None

    def create_timing_cache(self, serialized_timing_cache) -> ITimingCache:
        blob = bytes(serialized_timing_cache)
        _record("IBuilderConfig.create_timing_cache", len(blob))
        if not blob:
            return ITimingCache({})
        try:
            data = json.loads(blob)
            return ITimingCache(dict(data["entries"]), data["device"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError("Failed to deserialize the timing cache") from exc

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        _record("IBuilderConfig.set_timing_cache", len(cache.entries))
        if cache.device != TIMING_DEVICE and not ignore_mismatch:
            return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self.timing_cache

    def set_memory_pool_limit(self, pool, pool_size: int) -> None:
        _record("IBuilderConfig.set_memory_pool_limit", pool, pool_size)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        _record("IBuilderConfig.add_optimization_profile", sorted(profile.shapes))
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger):
        _record("Builder")

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        _record("Builder.create_network", flags)
        return INetworkDefinition()

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig):
        _record("Builder.build_serialized_network", len(config.profiles))
        arch = _graph_arch(network.onnx_path)
        memory = []
        for index, profile in enumerate(config.profiles):
            tensors = _profile_tensors(arch, profile.shapes)
            big = {n: v for n, v in tensors.items() if v > ELEMENT_LIMIT}
            if big:                            # TensorRT logs the layer and returns None
                _record("Builder.error", index, big)
                return None
            memory.append(_activation_bytes(arch, tensors))
            if config.timing_cache is not None:     # tactics timed at the profile's opt shapes
                key = json.dumps({"arch": arch, "opt": {n: s[1] for n, s in sorted(profile.shapes.items())}})
                hit = key in config.timing_cache.entries
                config.timing_cache.entries.setdefault(key, 1.0)
                _record("Builder.timing", index, "cached" if hit else "timed")
        return json.dumps({"tensorrt": __version__, "onnx": network.onnx_path, "memory": memory,
                           "profiles": [p.shapes for p in config.profiles]}).encode()


def _graph_arch(onnx_path: str) -> dict:
    """What the activation sizes depend on, read from the graph: its pool input's fixed
    dimensions and its weights' shapes."""
    import onnx

    model = onnx.load(onnx_path, load_external_data=False)
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    pool = next(i for i in model.graph.input if i.name == "kv_pool")
    dims = [d.dim_value for d in pool.type.tensor_type.shape.dim]
    kvh, hd = dims[3], dims[5]

    def weight(*ends: str) -> list[int]:
        return next(v for k, v in shapes.items() if k.endswith(ends))

    # a token's widest MLP activation: gate and up, of every expert where the graph runs them all
    # (or their [E, T, hidden] input and output, where wider)
    mlp = max(v[0] * max(v[1], v[2]) if len(v) == 3 else v[0]
              for k, v in shapes.items() if k.endswith("gate_up.weight"))
    embed = weight("embed.weight")
    itemsize = {1: 4, 10: 2, 16: 2}[pool.type.tensor_type.elem_type]
    if any(k.endswith("qkv.weight") for k in shapes):
        H, key = weight("qkv.weight")[0] // hd - 2 * kvh, kvh * hd
    else:           # latent attention: every head's key (q's width) and value (o's) made from a latent
        q, kv_b, o = weight("attn.q_b.weight", "attn.q.weight"), weight("kv_b.weight"), weight("attn.o.weight")
        H, key = (q[0] - kv_b[0] + o[1]) // (hd - kv_b[1]), max(hd, q[0] + o[1])
    return {"H": H, "key": key, "mlp": mlp, "vocab": embed[0], "hidden": embed[1], "itemsize": itemsize}


def _profile_tensors(arch: dict, shapes: dict) -> dict[str, int]:
    """Elements of each I/O tensor at the profile's maxima (the pool too), and of the graph's
    largest intermediates: attention scores and gathered K/V of both groups, the MLP, the logits."""
    mx = {name: s[2] for name, s in shapes.items()}
    out = {n: int(np.prod(s)) for n, s in mx.items()}
    H, key = arch["H"], arch["key"]
    bs = mx["kv_pool"][4]
    C, Q = mx["chunk_index"]
    Wc, (D, Wd), T = mx["chunk_blocks"][2], mx["dec_blocks"][1:], mx["input_ids"][0]
    out.update({
        "chunk_scores": C * H * Q * (Wc * bs + Q), "chunk_kv": C * (Wc * bs + Q) * key,
        "decode_scores": D * Wd * bs * H, "decode_kv": D * Wd * bs * key,
        "mlp": T * arch["mlp"], "logits": mx["logits_index"][0] * arch["vocab"]})
    return out


def _activation_bytes(arch: dict, t: dict[str, int]) -> int:
    size = arch["itemsize"]
    attention = max(3 * 4 * t["chunk_scores"] + 4 * size * t["chunk_kv"],
                    3 * 4 * t["decode_scores"] + 2 * size * t["decode_kv"])
    return attention + 2 * size * t["mlp"] + 4 * t["logits"] + (1 << 30)


class Runtime:
    def __init__(self, logger: Logger):
        _record("Runtime")

    def deserialize_cuda_engine(self, serialized_engine: bytes):
        _record("Runtime.deserialize_cuda_engine")
        data = json.loads(serialized_engine)
        if data["tensorrt"] != __version__:     # TensorRT refuses another version's plan
            return None
        return ICudaEngine(data)


class ICudaEngine:
    def __init__(self, data):
        import onnxruntime as ort

        self.profiles = data["profiles"]
        self.memory = data["memory"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.session = ort.InferenceSession(data["onnx"], so, providers=["CPUExecutionProvider"])
        self.io = {t.name: (t.shape, t.type) for t in self.session.get_inputs() + self.session.get_outputs()}

    def get_tensor_dtype(self, name: str) -> str:
        return _TRT_TYPES[self.io[name][1]]

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    @property
    def device_memory_size_v2(self) -> int:
        return max(self.memory)

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self.memory[profile_index]

    def create_execution_context(self, strategy: int = ExecutionContextAllocationStrategy.STATIC):
        _record("ICudaEngine.create_execution_context", strategy)
        if strategy == ExecutionContextAllocationStrategy.USER_MANAGED:
            return IExecutionContext(self)
        if allocated[0] + self.device_memory_size_v2 > DEVICE_MEMORY:
            return None                     # TensorRT logs "out of memory" and returns null
        allocated[0] += self.device_memory_size_v2
        ctx = IExecutionContext(self)
        ctx.memory_size = self.device_memory_size_v2
        return ctx


_DTYPES = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16,
           **({"tensor(bfloat16)": ml_dtypes.bfloat16} if ml_dtypes else {})}


def _array(address: int, shape, onnx_type: str) -> np.ndarray:
    dt = np.dtype(_DTYPES[onnx_type])
    n = int(np.prod(shape))
    if n == 0:
        return np.empty(shape, dtype=dt)
    raw = (ctypes.c_uint8 * (n * dt.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dt).reshape(shape)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.profile = 0                    # TensorRT's default: the code must select its own
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.memory_size = 0                # activation bytes it was given or allocated

    def set_device_memory(self, memory: int, size: int) -> None:
        _record("IExecutionContext.set_device_memory", size)
        assert memory % ALIGNMENT == 0, f"device memory at {memory:#x} is not {ALIGNMENT}-byte aligned"
        self.memory_size = size

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        _record("IExecutionContext.set_optimization_profile_async", profile_index)
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            # the bindings turn the C++ call's false into an exception (they never return False)
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = profile_index
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """An input's shape as set; an output's inferred from them (-1 where one is unset)."""
        if name in self.shapes:
            return self.shapes[name]
        sizes: dict[str, int] = {}
        for inp, shape in self.shapes.items():
            for dim, n in zip(self.engine.io[inp][0], shape):
                if isinstance(dim, str):
                    sizes[dim] = n
        return tuple(d if isinstance(d, int) else sizes.get(d, -1) for d in self.engine.io[name][0])

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.profiles[self.profile][name]
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not memory or memory % ALIGNMENT:      # TensorRT logs the error and returns false
            return False
        self.addresses[name] = memory
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        _record("IExecutionContext.execute_async_v3", self.profile, dict(self.shapes))
        if self.memory_size < self.engine.memory[self.profile]:
            return False                        # no (or too little) activation memory
        sess = self.engine.session
        feeds = {i.name: _array(self.addresses[i.name], self.shapes[i.name], i.type)
                 for i in sess.get_inputs()}
        for meta, value in zip(sess.get_outputs(), sess.run(None, feeds)):
            assert value.shape == self.get_tensor_shape(meta.name), (meta.name, value.shape)
            _array(self.addresses[meta.name], value.shape, meta.type)[...] = value
        return True


def aligned_zeros(shape, dtype, device):
    """The pool at a 256-byte boundary, as CUDA's allocator gives it (the CPU's gives 64)."""
    import torch

    from twophase.backends.tensorrt import aligned_empty

    return aligned_empty(tuple(shape), dtype, torch.device(device)).zero_()


def install(monkeypatch, tmp_path) -> list:
    """TensorRT replaced by this stand-in, the GPU by the CPU, the engine cache by ``tmp_path``;
    the ONNX graphs the engines are built from stay the suite's (exported once, by manifest, not
    once a test). Returns the list the calls are recorded in."""
    import sys

    import pytest

    pytest.importorskip("onnxruntime")
    import twophase.builder.pool
    from twophase.backends.tensorrt import TensorRTBackend
    from twophase.exporters import tensorrt as exporter
    from twophase.paths import cache_dir

    shared_onnx = cache_dir() / "onnx"
    shared_onnx.mkdir(parents=True, exist_ok=True)
    (tmp_path / "onnx").symlink_to(shared_onnx, target_is_directory=True)
    module = sys.modules[__name__]
    monkeypatch.setattr(twophase.builder.pool, "zeros", aligned_zeros)
    monkeypatch.setattr(module, "allocated", [0])
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(TensorRTBackend, "check_available", classmethod(lambda cls, device="cuda": None))
    monkeypatch.setattr(exporter, "gpu_identity", lambda index=0: {"gpu": "Stand-in GPU",
                                                                   "compute_capability": "9.0"})
    monkeypatch.setenv("TWOPHASE_CACHE", str(tmp_path))
    calls.clear()
    return calls
