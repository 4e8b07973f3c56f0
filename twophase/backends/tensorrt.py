"""The TensorRT backend: one engine (``twophase.exporters.tensorrt``) with a prefill and a decode
optimisation profile, run on the torch CUDA stream over the shared KV pool.

A profile binds to one execution context at a time, so the backend keeps one context per
profile, selected once with ``set_optimization_profile_async``. Each call sets the input shapes,
binds the pool, the small index tensors and torch-allocated outputs by device address
(``set_tensor_address``: no copies) and enqueues ``execute_async_v3`` on torch's current stream,
so the K/V write-back and sampling that follow are ordered after it without a sync.

The engine is built when the pool is bound (its block count and block size are profile shapes).
Written against TensorRT 11's Python API; no machine of this project has TensorRT and a GPU
together, so only the calls' sequence has been checked (against a recording stand-in).
"""

from __future__ import annotations

import logging

import torch

from twophase.backends.base import (
    Backend,
    BackendConfig,
    BackendUnavailable,
    Capabilities,
    DecodeBatch,
    EngineLimits,
    KVCache,
    KVCacheSpec,
    ModelSpec,
    PrefillBatch,
    parse_device,
)
from twophase.backends.hookspecs import hookimpl
from twophase.device import require_device
from twophase.errors import ConfigError
from twophase.graph.inputs import step_inputs, write_new_kv
from twophase.graph.signature import STEP
from twophase.models.shapes import LlamaArch

log = logging.getLogger(__name__)
OPTIONS = {"engine_dir", "rebuild"}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TensorRTBackend(Backend):
    name = "tensorrt"

    @classmethod
    def check_available(cls, device: str = "cuda") -> None:
        from twophase.exporters.tensorrt import import_tensorrt

        import_tensorrt()
        if parse_device(device).type != "cuda":
            raise BackendUnavailable(f"TensorRT runs on NVIDIA GPUs: set backend.device = "
                                     f"\"cuda\", not {device!r}")
        require_device(device)

    def capabilities(self) -> Capabilities:
        lim = self.limits
        return Capabilities(devices=("cuda",), dtypes=DTYPES, max_num_seqs=lim.max_num_seqs,
                            max_num_tokens=lim.max_num_batched_tokens)

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        if model.dtype not in DTYPES:
            raise ConfigError("model.dtype", f"TensorRT runs {', '.join(map(str, DTYPES))}, "
                                             f"not {model.dtype}")
        self.model, self.cfg = model, cfg
        self.limits = cfg.limits or EngineLimits(64, 2048, model.arch["max_position_embeddings"])
        self.arch = LlamaArch.from_dict(model.arch)
        self.device = torch.device(cfg.device)

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, self.model.dtype, self.device)

    def bind_kv_cache(self, kv: KVCache) -> None:
        from twophase.exporters import tensorrt as exporter

        trt = exporter.import_tensorrt()
        opts = self.cfg.options
        path = exporter.export(self.model, self.limits, kv.block_size, kv.num_blocks,
                               opts.get("engine_dir"), force=bool(opts.get("rebuild", False)),
                               device_index=self.device.index or 0)
        self.engine_path = path
        self.trt_logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.trt_logger)
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise exporter.EngineMismatch(
                f"TensorRT {trt.__version__} could not load {path} (built by another TensorRT "
                f"version or for another GPU?): delete it to rebuild")
        stream = self._stream()
        self.contexts = []
        for profile in (exporter.PREFILL, exporter.DECODE):
            ctx = self.engine.create_execution_context()
            if not ctx.set_optimization_profile_async(profile, stream):
                raise exporter.EngineMismatch(f"{path} has no optimisation profile {profile}")
            self.contexts.append(ctx)
        self.kv = kv
        # a valid address for empty inputs (the decode profile's chunk group)
        self.placeholder = torch.zeros(1, dtype=torch.long, device=self.device)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    # -- the two operations -----------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        from twophase.exporters.tensorrt import PREFILL

        return self._run(PREFILL, batch)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        from twophase.exporters.tensorrt import DECODE

        return self._run(DECODE, batch.as_prefill())

    def _run(self, profile: int, batch: PrefillBatch) -> torch.Tensor:
        ctx = self.contexts[profile]
        feeds = step_inputs(batch, self.kv.block_size)
        feeds = {n: self.kv.pool if n == "kv_pool" else feeds[n].to(self.device, non_blocking=True)
                 for n in STEP.names}
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(f"TensorRT refused shape {tuple(t.shape)} for {name} in "
                                   f"profile {profile} (outside the engine's profile)")
            ctx.set_tensor_address(name, (t if t.numel() else self.placeholder).data_ptr())
        a = self.arch
        T, N = feeds["input_ids"].shape[0], feeds["logits_index"].shape[0]
        dt = self.model.dtype
        outs = {"logits": torch.empty(N, a.vocab_size, dtype=torch.float32, device=self.device),
                "new_k": torch.empty(a.num_layers, T, a.num_kv_heads, a.head_dim, dtype=dt, device=self.device),
                "new_v": torch.empty(a.num_layers, T, a.num_kv_heads, a.head_dim, dtype=dt, device=self.device)}
        for name, t in outs.items():
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(self._stream()):
            raise RuntimeError("TensorRT failed to enqueue the step")
        write_new_kv(self.kv.pool, outs["new_k"], outs["new_v"], batch.slot_mapping.to(self.device))
        return outs["logits"]


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [TensorRTBackend]
