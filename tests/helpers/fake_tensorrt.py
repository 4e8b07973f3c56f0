"""A recording stand-in for the ``tensorrt`` module (TensorRT 11's Python API), for machines
without TensorRT or a GPU.

It implements exactly the methods twophase calls, with their real signatures, records each call,
and enforces what TensorRT enforces: a context runs the profile it selected, every input's shape
must lie within that profile, every I/O tensor needs an address. Its "engine" is the ONNX graph
the parser read, run by ONNX Runtime on the CPU, reading and writing the bound host addresses,
so a backend driven through it computes real tokens.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

__version__ = "11.0.0-standin"
calls: list[tuple] = []                    # (method, args...) in call order


def _record(*call):
    calls.append(call)


class Logger:
    WARNING = 2

    def __init__(self, min_severity=WARNING):
        _record("Logger", min_severity)


class MemoryPoolType:
    WORKSPACE = "WORKSPACE"


class INetworkDefinition:
    pass


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Logger):
        self.network = network
        self.num_errors = 0

    def parse_from_file(self, model: str) -> bool:
        _record("OnnxParser.parse_from_file", model)
        self.network.onnx_path = model
        return True

    def get_error(self, index: int):
        raise IndexError(index)


class IOptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, input: str, min, opt, max) -> None:   # noqa: A002 (TensorRT's names)
        assert all(a <= b <= c for a, b, c in zip(min, opt, max)), (input, min, opt, max)
        self.shapes[input] = [list(min), list(opt), list(max)]


class IBuilderConfig:
    def __init__(self):
        self.profiles: list[IOptimizationProfile] = []

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
        return json.dumps({"tensorrt": __version__, "onnx": network.onnx_path,
                           "profiles": [p.shapes for p in config.profiles]}).encode()


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
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.session = ort.InferenceSession(data["onnx"], so, providers=["CPUExecutionProvider"])

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_execution_context(self) -> "IExecutionContext":
        _record("ICudaEngine.create_execution_context")
        return IExecutionContext(self)


_CTYPES = {"tensor(int64)": (ctypes.c_int64, np.int64), "tensor(float)": (ctypes.c_float, np.float32)}


def _array(address: int, shape, onnx_type: str) -> np.ndarray:
    ct, dt = _CTYPES[onnx_type]
    n = int(np.prod(shape))
    if n == 0:
        return np.empty(shape, dtype=dt)
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ct)), shape=(n,)).reshape(shape)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self.engine = engine
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        _record("IExecutionContext.set_optimization_profile_async", profile_index)
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            return False
        self.profile = profile_index
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.profiles[self.profile][name]
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        assert memory, f"{name}: a null address"
        self.addresses[name] = memory
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        _record("IExecutionContext.execute_async_v3", self.profile, dict(self.shapes))
        sess = self.engine.session
        feeds = {i.name: _array(self.addresses[i.name], self.shapes[i.name], i.type)
                 for i in sess.get_inputs()}
        for meta, value in zip(sess.get_outputs(), sess.run(None, feeds)):
            _array(self.addresses[meta.name], value.shape, meta.type)[...] = value
        return True
