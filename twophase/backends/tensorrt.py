"""The TensorRT backend: one engine (``twophase.exporters.tensorrt``) with a ladder of
optimisation profiles (rungs), run over the shared KV pool on a CUDA stream of its own.

A profile binds to one execution context at a time, so the backend keeps one context per
profile, selected once with ``set_optimization_profile_async`` (a new context starts on profile
0). The contexts share one activation buffer (``USER_MANAGED`` contexts given the largest
``get_device_memory_size_for_profile_v2``): their calls run one after another on one stream, so
the engine never needs more than its largest profile. Each step is cut into calls that each fit
a rung (``twophase.backends.trt_calls``); each call sets the input shapes, binds the pool, the
small index tensors and torch-allocated outputs by device address (``set_tensor_address``: no
copies, 256-byte aligned) and enqueues ``execute_async_v3`` on the backend's stream, which waits
for torch's current stream first and which torch's waits for after, so the K/V write-back and
sampling are ordered after it without a host sync.

The engine is built when the pool is bound (its block size is a profile shape; its block count
a dynamic dimension, tuned for the pool bound). TensorRT refuses a tensor of more than 2^31 - 1
elements, the pool included (many of its kernels address offsets in 32 bits; the limit is not
configurable), so the backend declares that limit (``Capabilities.max_pool_elements``: an
automatic pool is sized within it) and refuses a larger pool by its block count. Each call's
outputs are allocated as the engine says they are (``get_tensor_shape`` once the input shapes
are set, ``get_tensor_dtype``), never as this code assumes. Written against TensorRT 11's Python
API; no machine of this project has had TensorRT and a GPU together, so the calls have been
checked against a stand-in that keeps TensorRT's rules (``tests/helpers/fake_tensorrt.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from twophase.backends.hookspecs import hookimpl
from twophase.backends.traced import MOE, MOE_TENSORRT, TRACED_FEATURES
from twophase.backends.trt_calls import last_rows, plan_calls, sub_batch
from twophase.cache.layout import KVHeads
from twophase.contract import (
    CONTRACT_VERSION,
    Backend,
    BackendConfig,
    BackendMemory,
    BackendUnavailable,
    Capabilities,
    DecodeBatch,
    EngineLimits,
    KVCache,
    KVCacheSpec,
    MemoryQuery,
    ModelSpec,
    PrefillBatch,
    Workspace,
    parse_device,
)
from twophase.device import available_memory, require_device
from twophase.errors import ConfigError
from twophase.graph.inputs import step_inputs, write_new_kv
from twophase.graph.signature import STEP

log = logging.getLogger(__name__)
OPTIONS = {"engine_dir", "rebuild"}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TensorRTBackend(Backend):
    name = "tensorrt"
    contract_version = CONTRACT_VERSION

    @classmethod
    def check_available(cls, device: str = "cuda") -> None:
        from twophase.exporters.tensorrt import import_tensorrt, require_export_packages

        import_tensorrt()
        require_export_packages()
        if parse_device(device).type != "cuda":
            raise BackendUnavailable(f"TensorRT runs on NVIDIA GPUs: set backend.device = "
                                     f"\"cuda\", not {device!r}")
        require_device(device)

    @classmethod
    def memory(cls, query: MemoryQuery) -> BackendMemory:
        """Its activations are its profiles' memory (the largest profile's: the contexts share
        one buffer), so the generic step peak does not apply."""
        from twophase.exporters.trt_profiles import profile_memory

        need = profile_memory(query.arch, query.limits, query.num_blocks, query.block_size, query.dtype)
        profiles = Workspace("TensorRT profiles", int(need), "the largest profile's activations and builder workspace")
        return dataclasses.replace(super().memory(query), step_activations=False, workspace=profiles)

    def capabilities(self) -> Capabilities:
        """Before load (the engine asks what it computes) the profiles' limits are not known
        yet; the pool's limit is TensorRT's, whatever the model."""
        from twophase.exporters import trt_profiles

        lim = getattr(self, "limits", None)
        return Capabilities(features=TRACED_FEATURES | MOE, devices=("cuda",), dtypes=DTYPES,
                            max_num_seqs=lim.max_num_seqs if lim else None,
                            max_num_tokens=lim.max_num_batched_tokens if lim else None,
                            max_pool_elements=trt_profiles.ELEMENT_LIMIT, kv_groups=True,
                            computes={"moe": MOE_TENSORRT})

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        from twophase.exporters.tensorrt import require_export_packages

        self.check_available(cfg.device)
        require_export_packages()
        cfg.check_options(OPTIONS)
        if model.dtype not in DTYPES:
            raise ConfigError("model.dtype", f"TensorRT runs {', '.join(map(str, DTYPES))}, "
                                             f"not {model.dtype}")
        self.model, self.cfg = model, cfg
        self.limits = cfg.limits or EngineLimits(64, 2048, model.arch.max_position_embeddings)
        self.arch = model.arch
        self.device = torch.device(cfg.device)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVHeads.of(self.arch).spec(self.arch.num_layers, self.model.dtype, self.device)

    def bind_kv_cache(self, kv: KVCache) -> None:
        from twophase.exporters import tensorrt as exporter
        from twophase.exporters import trt_profiles

        if kv.pool.dtype != self.model.dtype:
            raise ConfigError("cache.dtype", f"the tensorrt backend's engine reads a "
                              f"{self.model.dtype} pool, not {kv.pool.dtype}")
        check_aligned("kv_pool", kv.pool)
        check_pool_elements(kv, self.arch)
        trt = exporter.import_tensorrt()
        self.rungs = trt_profiles.rungs(self.model.arch, self.limits, kv.num_blocks, kv.block_size)
        need = trt_profiles.profile_memory(self.model.arch, self.limits, kv.num_blocks,
                                           kv.block_size, self.model.dtype)
        if self.device.type == "cuda":
            trt_profiles.check_fits(need, available_memory(str(self.device)))
        opts = self.cfg.options
        path = exporter.export(self.model, self.limits, kv.block_size, kv.num_blocks,
                               opts.get("engine_dir"), force=bool(opts.get("rebuild", False)),
                               device_index=self.device.index or 0, slots=kv.pool.shape[0])
        self.engine_path = path
        self.trt_logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.trt_logger)
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise exporter.EngineMismatch(
                f"TensorRT {trt.__version__} could not load {path} (built by another TensorRT "
                f"version or for another GPU?): delete it to rebuild")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.contexts = self._contexts(trt, path)
        self.out_dtypes = {name: torch_dtype(trt, self.engine.get_tensor_dtype(name), name)
                           for name in STEP.outputs}
        self.kv = kv
        # a valid address for empty inputs (the decode profile's chunk group)
        self.placeholder = aligned_empty((1,), torch.long, self.device).zero_()

    def _contexts(self, trt, path) -> list:
        """One execution context per profile, all on one activation buffer of the largest
        profile's size."""
        n = len(self.rungs)
        if self.engine.num_optimization_profiles != n:
            raise exporter_mismatch(f"{path} has {self.engine.num_optimization_profiles} "
                                    f"optimisation profiles, not {n}: delete it to rebuild")
        size = max(self.engine.get_device_memory_size_for_profile_v2(p) for p in range(n))
        self.activations = aligned_empty((max(size, 1),), torch.uint8, self.device)
        contexts = []
        for profile in range(n):
            ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if ctx is None:
                raise RuntimeError(f"TensorRT could not create an execution context for {path} "
                                   f"(out of device memory?)")
            ctx.set_device_memory(self.activations.data_ptr(), size)
            try:      # TensorRT's bindings raise where the C++ call returns false
                ok = ctx.set_optimization_profile_async(profile, self._stream())
            except RuntimeError as exc:
                raise exporter_mismatch(f"{path}: TensorRT refused optimisation profile {profile} "
                                        f"({exc}): delete it to rebuild") from exc
            if ok is False:
                raise exporter_mismatch(f"{path}: TensorRT refused optimisation profile {profile}: "
                                        f"delete it to rebuild")
            contexts.append(ctx)
        return contexts

    def _stream(self) -> int:
        return self.stream.cuda_stream if self.stream is not None else 0

    # -- the two operations -----------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        return self._step(batch)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        return self._step(batch.as_prefill())

    def _step(self, batch: PrefillBatch) -> torch.Tensor:
        """The batch as calls that fit the rungs, in order, each one's K/V written before the
        next reads the pool; the logits gathered back in the batch's order."""
        rows = batch.num_tokens if batch.logits == "all" else batch.num_seqs
        out = torch.empty(rows, self.arch.vocab_size, dtype=torch.float32, device=self.device)
        for call in plan_calls(self.rungs, batch.start_positions, batch.query_lens, self.kv.block_size):
            sub, idx = sub_batch(batch, call.pieces)
            logits = self._run(call.rung, sub)
            if batch.logits == "all":
                out[idx.to(self.device)] = logits
            else:
                got, seqs = last_rows(batch, call.pieces)
                out[torch.tensor(seqs, dtype=torch.long, device=self.device)] = logits[
                    torch.tensor(got, dtype=torch.long, device=self.device)]
        return out

    def _run(self, profile: int, batch: PrefillBatch) -> torch.Tensor:
        ctx = self.contexts[profile]
        feeds = step_inputs(batch, self.kv, decodes=self.rungs[profile].phase == "decode")
        feeds = {n: self.kv.pool if n == "kv_pool" else aligned(feeds[n].to(self.device, non_blocking=True))
                 for n in STEP.names}
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(f"TensorRT refused shape {tuple(t.shape)} for {name} in "
                                   f"profile {profile} (outside the engine's profile)")
            self._bind(ctx, name, t if t.numel() else self.placeholder)
        outs = {name: aligned_empty(self._output_shape(ctx, name, profile), self.out_dtypes[name], self.device)
                for name in STEP.outputs}
        T, N = feeds["input_ids"].shape[0], feeds["logits_index"].shape[0]
        a = self.arch
        if outs["logits"].shape != (N, a.vocab_size) or outs["new_k"].shape[:2] != (a.num_layers, T):
            raise exporter_mismatch(f"{self.engine_path}: the engine's outputs are logits "
                                    f"{tuple(outs['logits'].shape)} and new_k {tuple(outs['new_k'].shape)} "
                                    f"for {T} tokens and {N} logit rows: not this model's step graph; "
                                    f"delete it to rebuild")
        for name, t in outs.items():
            self._bind(ctx, name, t)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not ctx.execute_async_v3(self._stream()):
            raise RuntimeError("TensorRT failed to enqueue the step")
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        write_new_kv(self.kv.pool, outs["new_k"].to(self.kv.pool.dtype), outs["new_v"].to(self.kv.pool.dtype),
                     batch.slot_mapping, self.kv.groups)
        return outs["logits"].float()

    @staticmethod
    def _output_shape(ctx, name: str, profile: int) -> tuple[int, ...]:
        """An output's shape as the engine computes it from the input shapes set."""
        shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise RuntimeError(f"TensorRT left output {name}'s shape {shape} unresolved in profile "
                               f"{profile} (an input shape not set?)")
        return shape

    @staticmethod
    def _bind(ctx, name: str, t: torch.Tensor) -> None:
        if not ctx.set_tensor_address(name, t.data_ptr()):
            raise RuntimeError(f"TensorRT refused the address of {name} ({tuple(t.shape)} "
                               f"{t.dtype} at {t.data_ptr():#x})")


ALIGNMENT = 256           # TensorRT's requirement on every I/O tensor's address
TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                "INT64": torch.int64, "INT32": torch.int32}


def torch_dtype(trt, dtype, name: str) -> torch.dtype:
    """The torch dtype of a TensorRT ``DataType``, for the tensor ``name``."""
    for key, value in TORCH_DTYPES.items():
        if dtype == getattr(trt.DataType, key, None):
            return value
    raise RuntimeError(f"the engine's {name} is {dtype}, a TensorRT type this backend does not bind")


def check_pool_elements(kv: KVCache, arch) -> None:
    """Refuse a pool TensorRT cannot bind (more than ``ELEMENT_LIMIT`` elements), naming the
    most blocks that fit."""
    from twophase.exporters import trt_profiles

    n, limit = kv.pool.numel(), trt_profiles.ELEMENT_LIMIT
    if n <= limit:
        return
    most = limit // (n // kv.num_blocks)
    raise ConfigError("cache.num_blocks", f"a pool of {kv.num_blocks} blocks holds {n:,} elements; "
                      f"TensorRT binds no tensor of more than {limit:,} (its kernels address "
                      f"offsets in 32 bits; the limit is not configurable): at most {most} blocks "
                      f"({most * kv.block_size} tokens) of {arch.num_layers} layers, or leave "
                      f"cache.num_blocks unset to size the pool within it")


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor whose address is a multiple of ``ALIGNMENT`` (CUDA's allocator
    gives 512; the CPU's only 64, where the stand-in runs)."""
    n = max(1, math.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n + ALIGNMENT, dtype=torch.uint8, device=device)
    start = -raw.data_ptr() % ALIGNMENT
    return raw[start:start + n].view(dtype)[:math.prod(shape)].view(shape)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it at an aligned address."""
    if t.data_ptr() % ALIGNMENT == 0 and t.is_contiguous():
        return t
    return aligned_empty(tuple(t.shape), t.dtype, t.device).copy_(t)


def check_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % ALIGNMENT:
        raise RuntimeError(f"{name} starts at {t.data_ptr():#x}, not on the {ALIGNMENT}-byte "
                           f"boundary TensorRT requires")


def exporter_mismatch(message: str) -> Exception:
    from twophase.exporters.tensorrt import EngineMismatch

    return EngineMismatch(message)


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [TensorRTBackend]
