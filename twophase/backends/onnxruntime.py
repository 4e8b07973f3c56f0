"""The ONNX Runtime backend: the exported step graph (``twophase.exporters.onnx``) in an ORT
session, CPU execution provider on ``device = "cpu"``, CUDA execution provider on ``"cuda"``.

Zero-copy: the engine's KV pool, the small index inputs and the outputs are bound with IOBinding
on the tensors' own memory (device pointers on CUDA), so a step copies neither the pool nor
anything through the host; the index inputs are built on the host each step (block ids, masks).
The graph returns the new tokens' K/V; they are written into the pool at the batch's slots
(``index_copy_`` on the pool itself).

On CUDA the session computes on a CUDA stream of the backend's own (the provider's
``user_compute_stream``), which waits for torch's current stream before each run and which
torch's waits for after it; the index inputs go up from pinned memory without blocking, the
outputs stay on the device and the run does not wait for the device at its end
(``disable_synchronize_execution_providers``). So a step never makes the host wait: the one sync
is the engine's, when it reads the sampled tokens. bfloat16 runs on CUDA (onnxruntime >= 1.20
binds it by its ONNX element type; a graph op without a bfloat16 CUDA kernel is refused by
name when the session loads). q4 (``MatMulNBits`` with int8 activations, ``accuracy_level``)
runs on the CPU only.

Steps that are all decodes run a second, decode-only graph on the CPU
(``twophase.exporters.decode_graph``): a batch-1 decode step is 1.4x faster. Batches of short
chunks (a speculative verify pass: each decode and its drafts; at most ``SHORT_CHUNK`` tokens,
padded to the longest) run a third, its variant with ``Q`` tokens a sequence, where the step
graph's ~4,900 nodes cost a verify pass about two decode steps. Each holds its own copy of the
weights; option ``decode_graph = false`` keeps every step on the step graph.

A model with state layers (Gated DeltaNet, short convolutions, Mamba-2) runs its decodes here:
the step graph takes the decodes' states gathered at their slots and returns the new ones,
written back at the slots (``graph.inputs.state_inputs``/``write_states``). Its prefill is
refused by name (``Capabilities.features_in``): route it to torch (``[backend.prefill] name =
"torch"``, ``[backend.decode] name = "onnxruntime"``).

The CUDA path is written from ONNX Runtime's documentation and has not run on this project's
machines (none has ``onnxruntime-gpu`` and a GPU together).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any

import numpy as np
import torch

from twophase.backends.hookspecs import hookimpl
from twophase.backends.traced import GRAPH_FEATURES, MOE_ONNXRUNTIME, STATE_DECODE, TRACED_FEATURES
from twophase.cache.layout import KVHeads
from twophase.contract import (
    CONTRACT_VERSION,
    Backend,
    BackendConfig,
    BackendMemory,
    BackendUnavailable,
    Capabilities,
    DecodeBatch,
    KVCache,
    KVCacheSpec,
    MemoryQuery,
    ModelSpec,
    PrefillBatch,
    parse_device,
)
from twophase.device import require_device, threads_option
from twophase.errors import ConfigError, install_hint
from twophase.graph.inputs import (
    decode_graph_inputs,
    state_inputs,
    step_inputs,
    verify_graph_inputs,
    write_new_kv,
    write_states,
)

log = logging.getLogger(__name__)
OPTIONS = {"threads", "inter_op_threads", "graph_optimization_level", "spinning", "export_dir",
           "decode_graph"}
LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
          "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
SHORT_CHUNK = 33            # the longest chunk the verify graph takes (32 drafts and a decode)
# The graphs gather K/V blocks from the whole pool. onnxruntime's CUDA Gather computed its
# source offsets in 32 bits (a pool past 2^31 - 1 elements read out of bounds) until its PR 28108,
# merged in April 2026 and first released in 1.26.
GATHER_LIMIT = 2**31 - 1
GATHER_FIXED = (1, 26)
NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
# numpy has no bfloat16: onnxruntime's IOBinding takes it by its ONNX element type since 1.20
ONNX_BFLOAT16 = 16
BF16_BINDING = (1, 20)


def weight_copies(query: MemoryQuery) -> int:
    """The sessions that each hold the weights: the step graph, and on the CPU for float32
    models without biases the decode and verify graphs (``decode_graph = false`` leaves them out)."""
    extra = (query.device_kind == "cpu" and query.dtype == "float32"
             and query.options.get("decode_graph", True) and not query.arch.features())
    return 3 if extra else 1


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailable(f"onnxruntime is not installed: {install_hint('onnx')} (CPU), or the "
                                 f"onnx-cuda extra (GPU)") from None
    return onnxruntime


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    contract_version = CONTRACT_VERSION
    quantizations = ("none", "q4")      # q4: MatMulNBits over the GGUF's blocks (CPU only)
    stream = None                       # CUDA: the stream its sessions compute on
    run_options = None

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        ort = _ort()
        kind = parse_device(device).type
        if kind == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BackendUnavailable(
                f"onnxruntime {ort.__version__} has no CUDA execution provider "
                f"(providers: {', '.join(ort.get_available_providers())}): {install_hint('onnx-cuda')} "
                f"(onnxruntime-gpu, never beside onnxruntime)")
        require_device(device)
        if kind not in ("cpu", "cuda"):
            raise BackendUnavailable(f"device {device!r}: onnxruntime runs on cpu or cuda here")

    @classmethod
    def memory(cls, query: MemoryQuery) -> BackendMemory:
        """A copy of the weights in each session (``weight_copies``), and a float model's tied
        head prepacked apart from the embedding's Gather."""
        return dataclasses.replace(super().memory(query), weight_copies=weight_copies(query),
                                   tied_head_apart=query.quantization != "q4")

    def capabilities(self) -> Capabilities:
        cuda = getattr(self, "device", None) is not None and self.device.type == "cuda"
        old_gather = cuda and _release(_ort().__version__) < GATHER_FIXED
        dtypes = cuda_dtypes(_ort().__version__) if cuda else (torch.float32, torch.float16)
        # state layers in decode only, and on float weights (q4 rewrites the Llama block's projections)
        return Capabilities(features=GRAPH_FEATURES, devices=("cpu", "cuda"), dtypes=dtypes,
                            own_threads=True, max_pool_elements=GATHER_LIMIT if old_gather else None,
                            kv_groups=True, features_on={"q4": TRACED_FEATURES},
                            features_in={"prefill": GRAPH_FEATURES - STATE_DECODE},
                            computes={"moe": MOE_ONNXRUNTIME})

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        check_dtype(model, parse_device(cfg.device).type, _ort().__version__)
        use_decode_graph = cfg.options.get("decode_graph", True)
        if not isinstance(use_decode_graph, bool):
            raise ConfigError("backend.options.decode_graph",
                              f"must be true or false; got {use_decode_graph!r}")
        from twophase.exporters import onnx as exporter

        self.device = torch.device(cfg.device)
        self.arch = model.arch
        self.dtype = model.dtype
        self.quantization = model.quantization
        # CUDA: the stream the sessions compute on (see the module's docstring)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.run_options = run_options(_ort(), cuda=self.stream is not None)
        out = cfg.options.get("export_dir")
        path = exporter.export(model, out)
        try:
            self.session = self._session(path, cfg.options)
        except Exception as exc:     # a corrupt export (truncated weights, bad protobuf)
            if isinstance(exc, (BackendUnavailable, ConfigError)):     # not the export's fault
                raise
            log.warning("could not load %s (%s): exporting again", path, exc)
            path = exporter.export(model, out, force=True)
            self.session = self._session(path, cfg.options)
        wanted = use_decode_graph and self.device.type == "cpu"
        self.decode_session, self.verify_session = (
            self._decode_session(path.parent / name, cfg.options) if wanted else None
            for name in ("decode.onnx", "verify.onnx"))
        self.group = self.arch.num_heads // self.arch.num_kv_heads

    def _decode_session(self, path, options: dict[str, Any]):
        """A hand-built graph (decodes, or short chunks), unless it was not exported (a model
        with biases), its copy of the weights would crowd the KV pool out of memory or it does
        not load (the step graph then runs those steps: slower at small batches, never wrong)."""
        from twophase.device import available_memory
        from twophase.models.loader import weight_bytes

        if not path.exists():
            return None
        need, free = weight_bytes(self.arch, self.dtype), available_memory("cpu")
        if need > free / 2:
            log.warning("not loading %s: its copy of the weights (%.1f GiB) would leave too "
                        "little of %.1f GiB free; its steps run on the step graph", path.name,
                        need / 2**30, free / 2**30)
            return None
        try:
            return self._session(path, options)
        except Exception as exc:
            log.warning("could not load %s (%s): its steps run on the step graph", path, exc)
            return None

    def _session(self, path, options: dict[str, Any]):
        ort = _ort()
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads_option(options)
        so.inter_op_num_threads = threads_option(options, "inter_op_threads", default=1)
        level = options.get("graph_optimization_level", "all")
        if level not in LEVELS:
            raise ConfigError("backend.options.graph_optimization_level",
                              f"must be one of {', '.join(LEVELS)}; got {level!r}")
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
        # between ops of a run, threads spin (a decode step is thousands of ops of microseconds, and
        # waking sleeping threads for each costs a fifth of a step: docs/measurements.md); when
        # the run ends they stop, so they never steal the cores the engine needs between runs
        spin = options.get("spinning", True)
        if not isinstance(spin, bool):
            raise ConfigError("backend.options.spinning", f"must be true or false; got {spin!r}")
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
            so.add_session_config_entry(key, "1" if spin else "0")
        so.add_session_config_entry("session.force_spinning_stop", "1")
        if self.stream is not None:
            providers = [("CUDAExecutionProvider", {"device_id": self.device.index or 0,
                                                    "user_compute_stream": str(self.stream.cuda_stream)}),
                         "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            sess = ort.InferenceSession(str(path), so, providers=providers)
        except Exception as exc:
            refuse_missing_kernel(exc, self.dtype, ort.__version__)
            raise
        if self.device.type == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
            raise BackendUnavailable("onnxruntime could not start its CUDA execution provider "
                                     "(check that the CUDA and cuDNN libraries it needs load)")
        return sess

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVHeads.of(self.arch).spec(len(self.arch.attention_layers), self.dtype, self.device)

    def bind_kv_cache(self, kv: KVCache) -> None:
        if kv.pool.dtype != self.dtype:
            raise ConfigError("cache.dtype", f"the onnxruntime backend's graph reads a "
                              f"{self.dtype} pool, not {kv.pool.dtype}")
        if self.device.type == "cuda":
            check_cuda_gather(tuple(kv.pool.shape), _ort().__version__)
        self.kv = kv

    # -- the two operations -----------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        if self.kv.states:
            return self._state_decodes(batch)
        if self.verify_session is not None and self._short_chunks(batch):
            return self._verify(batch)
        inputs = step_inputs(batch, self.kv)
        logits, new_k, new_v = self._run(inputs)
        write_new_kv(self.kv.pool, new_k, new_v, batch.slot_mapping, self.kv.groups)
        return logits

    def _state_decodes(self, batch: PrefillBatch) -> torch.Tensor:
        """A step of a model with state layers: one-token sequences only (the graph computes
        their state layers' one step), the states gathered at their slots and written back."""
        if max(batch.query_lens) > 1:
            raise BackendUnavailable(self.supports_phase(self.arch, self.quantization, "prefill") or "")
        self.kv.copy_states(batch.state_copies)
        assert batch.state_slots is not None
        slots = batch.state_slots.to(self.device)
        states = state_inputs(self.kv, slots)
        new = {f"new_{n}": torch.empty_like(t) for n, t in states.items()}
        logits, new_k, new_v = self._run(step_inputs(batch, self.kv) | states, more_outputs=new)
        write_new_kv(self.kv.pool, new_k, new_v, batch.slot_mapping, self.kv.groups)
        write_states(self.kv, new, slots)
        return logits

    @staticmethod
    def _short_chunks(batch: PrefillBatch) -> bool:
        """Chunks the verify graph runs faster: short, and padding at most doubles them."""
        longest = max(batch.query_lens)
        return longest <= SHORT_CHUNK and longest * batch.num_seqs <= 2 * batch.num_tokens

    def _verify(self, batch: PrefillBatch) -> torch.Tensor:
        inputs, rows = verify_graph_inputs(batch, self.kv.pool, self.group, self.kv.groups)
        logits, new_k, new_v = self._run(inputs, self.verify_session)
        write_new_kv(self.kv.pool, new_k[:, rows], new_v[:, rows], batch.slot_mapping, self.kv.groups)
        if batch.logits == "last":
            rows = rows[torch.tensor(batch.query_start[1:]) - 1]
        return logits[rows]

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        if self.decode_session is None:
            return self.prefill(batch.as_prefill())
        logits, new_k, new_v = self._run(decode_graph_inputs(batch, self.kv.pool, self.kv.groups),
                                         self.decode_session)
        write_new_kv(self.kv.pool, new_k, new_v, batch.slot_mapping, self.kv.groups)
        return logits

    def _run(self, inputs: dict[str, torch.Tensor], session=None,
             more_outputs: dict[str, torch.Tensor] | None = None):
        """Logits, new K and new V of one run; ``more_outputs``: tensors bound to the graph's
        other outputs (a state model's new states)."""
        session = session or self.session
        dev = self.device
        kind, index = ("cuda", dev.index or 0) if dev.type == "cuda" else ("cpu", 0)
        io = session.io_binding()
        keep = []                                   # tensors must outlive the run
        for name, t in [("kv_pool", self.kv.pool), *inputs.items()]:
            t = self._to_device(t)
            keep.append(t)
            io.bind_input(name, kind, index, element_type(t.dtype), list(t.shape), t.data_ptr())
        T = inputs["input_ids"].shape[0]
        N = inputs["logits_index"].shape[0] if "logits_index" in inputs else T
        a, kv = self.arch, KVHeads.of(self.arch)
        L = len(a.attention_layers)
        outs = {"logits": torch.empty(N, a.vocab_size, dtype=torch.float32, device=dev),
                "new_k": torch.empty(L, T, kv.num_kv_heads, kv.head_dim, dtype=self.dtype, device=dev),
                "new_v": torch.empty(L, T, kv.num_kv_heads, kv.head_dim, dtype=self.dtype, device=dev),
                **(more_outputs or {})}
        for name, t in outs.items():
            keep.append(t)
            io.bind_output(name, kind, index, element_type(t.dtype), list(t.shape), t.data_ptr())
        if self.stream is None:
            io.synchronize_inputs()
            session.run_with_iobinding(io, self.run_options)
            io.synchronize_outputs()
            return outs["logits"], outs["new_k"], outs["new_v"]
        torch_stream = self._torch_stream()
        self.stream.wait_stream(torch_stream)       # the inputs' copies, the pool's last write
        for t in keep:                              # in use on the session's stream too
            t.record_stream(self.stream)
        session.run_with_iobinding(io, self.run_options)
        torch_stream.wait_stream(self.stream)       # the K/V write-back and sampling come after
        return outs["logits"], outs["new_k"], outs["new_v"]

    def _torch_stream(self):
        return torch.cuda.current_stream(self.device)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the backend's device, contiguous; a host tensor copied to CUDA from pinned
        memory without blocking (from pageable memory the copy would wait for the device)."""
        if self.stream is not None and t.device.type == "cpu":
            t = t.contiguous().pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device).contiguous()


def run_options(ort, cuda: bool):
    """Each run's options: on CUDA, no wait for the device at the run's end (the outputs stay
    on it, and torch's stream is ordered after the session's)."""
    options = ort.RunOptions()
    if cuda:
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


def element_type(dtype: torch.dtype):
    """What IOBinding takes for a tensor of ``dtype``: a numpy dtype, or bfloat16's ONNX
    element type (numpy has none)."""
    return ONNX_BFLOAT16 if dtype == torch.bfloat16 else NP_DTYPES[dtype]


def cuda_dtypes(version: str) -> tuple[torch.dtype, ...]:
    """The model dtypes the CUDA path runs with onnxruntime ``version``."""
    bf16 = (torch.bfloat16,) if _release(version) >= BF16_BINDING else ()
    return (torch.float32, torch.float16, *bf16)


def check_dtype(model: ModelSpec, device_kind: str, version: str) -> None:
    """Refuse, by name and with the reason, a dtype or weight format this backend does not run
    on ``device_kind``."""
    if model.quantization == "q4" and device_kind == "cuda":
        raise ConfigError("model.quantization", "q4 runs on the onnxruntime backend on the CPU "
                          "only: its MatMulNBits rounds activations to int8 (accuracy_level), as "
                          "measured there; the CUDA provider's MatMulNBits ignores accuracy_level "
                          "and has not been checked against it. Use device = \"cpu\", or the "
                          "float weights on CUDA")
    name = str(model.dtype).removeprefix("torch.")
    if device_kind == "cpu" and model.dtype != torch.float32:
        raise ConfigError("model.dtype", f"{name} is not supported by the onnxruntime backend on "
                          f"cpu (its CPU provider has no {name} kernels for most of the step "
                          f"graph's ops); use float32")
    if device_kind == "cuda" and model.dtype not in cuda_dtypes(version):
        why = (f"onnxruntime {version} binds no bfloat16 tensor (numpy has no bfloat16; "
               f"onnxruntime >= {'.'.join(map(str, BF16_BINDING))} takes its ONNX element type)"
               if model.dtype == torch.bfloat16 else "not a dtype the step graph is exported in")
        raise ConfigError("model.dtype", f"{name} on the onnxruntime backend on cuda: {why}; use "
                          f"float16 or float32")


def refuse_missing_kernel(exc: Exception, dtype: torch.dtype, version: str) -> None:
    """A session that would not load because no provider has a kernel for one of the graph's
    ops in ``dtype`` (onnxruntime's NOT_IMPLEMENTED): a ``ConfigError`` naming the op."""
    found = re.search(r"Could not find an implementation for (\S+?)\(\d+\) node with name '([^']*)'", str(exc))
    if found is None or dtype == torch.float32:
        return
    name = str(dtype).removeprefix("torch.")
    raise ConfigError("model.dtype", f"onnxruntime {version} has no {name} kernel for "
                      f"{found.group(1)} (node {found.group(2)!r}) on this device, so the step "
                      f"graph does not load in {name}: use float16 or float32") from exc


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def check_cuda_gather(pool_shape: tuple[int, ...], version: str) -> None:
    """Refuse a pool too large for the CUDA Gather of an onnxruntime without 64-bit offsets,
    naming the largest block count that fits."""
    elements = math.prod(pool_shape)
    if elements <= GATHER_LIMIT or _release(version) >= GATHER_FIXED:
        return
    blocks = pool_shape[2]
    raise ConfigError("cache.num_blocks", f"a pool of {blocks} blocks holds {elements:,} elements; "
                      f"onnxruntime {version} gathers from it on CUDA with 32-bit offsets "
                      f"({GATHER_LIMIT:,} elements at most): at most {GATHER_LIMIT // (elements // blocks)} "
                      f"blocks, or onnxruntime-gpu >= {'.'.join(map(str, GATHER_FIXED))}")


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [OnnxRuntimeBackend]
