"""The eager PyTorch backend (CPU and CUDA): runs ``twophase.models.decoder`` directly.

On CUDA, pure-decode steps replay CUDA graphs captured per (batch-size, context-blocks) bucket:
an eager decode of a large model is bound by kernel launches, not by memory bandwidth.

Option ``compute_dtype`` holds the weights and computes in another dtype than the model's (its
K/V still go into the engine's pool in the pool's own format): ``"bfloat16"`` for a prefill on a
CPU's matrix engine (oneDNN runs bf16 matmuls on AMX tiles), beside a decode backend in float32
over the same pool: ``[backend.prefill] name = "torch"``, ``options = {compute_dtype =
"bfloat16"}``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys
from typing import Any

import torch

from twophase.backends.hookspecs import hookimpl
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
)
from twophase.device import require_device, threads_option
from twophase.errors import ConfigError
from twophase.kv_formats import KV_FORMATS
from twophase.models.decoder import AttnMeta, Decoder, StateMeta
from twophase.models.state_dict import build_model

log = logging.getLogger(__name__)

# every departure of the families from the Llama block: the layers kit's decoder computes each.
# Named one by one, never derived from ``twophase.arch.FEATURES``: a feature added there is
# refused until the decoder computes it and this list names it.
TORCH_FEATURES = frozenset({
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "post_norms", "gelu_tanh", "embed_scale",
    "attn_softcap", "final_softcap", "query_scale", "partial_rotary", "rope_per_layer", "sliding_window", "moe",
    "gated_deltanet", "attn_output_gate", "short_conv", "mamba2", "no_rope", "residual_scale", "logit_divisor",
    "rope_yarn", "attn_sinks", "moe_bias", "clamped_swiglu", "mla", "moe_routing",
})
OPTIONS = {"threads", "cuda_graphs", "keep_freed_memory", "compute_dtype"}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchBackend(Backend):
    name = "torch"
    contract_version = CONTRACT_VERSION

    def __init__(self) -> None:
        self.model: Decoder | None = None
        self.kv: KVCache | None = None
        self.graphs = None
        self.groups = None
        self.lora: Any = None            # (LoraContext, wrapped projections) once adapters come

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        dev = require_device(device)
        kind = dev.type
        index = dev.index
        if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
            raise BackendUnavailable(f"device {device!r}: only {torch.cuda.device_count()} "
                                     f"CUDA device(s) here")
        if kind not in ("cpu", "cuda"):
            raise BackendUnavailable(f"device {device!r}: the torch backend runs on cpu or cuda")

    @classmethod
    def memory(cls, query: MemoryQuery) -> BackendMemory:
        """On CUDA its captured decode steps too, unless option ``cuda_graphs = false``; its
        weights in option ``compute_dtype`` where given."""
        graphs = query.device_kind == "cuda" and bool(query.options.get("cuda_graphs", True))
        held = query.options.get("compute_dtype")
        return dataclasses.replace(super().memory(query), cuda_graphs=graphs,
                                   dtype=held if held in COMPUTE_DTYPES else None)

    def capabilities(self) -> Capabilities:
        return Capabilities(devices=("cpu", "cuda"), features=TORCH_FEATURES,
                            dtypes=(torch.float32, torch.bfloat16, torch.float16), kv_groups=True,
                            kv_formats=tuple(KV_FORMATS), adapters=True, hidden_states=True)

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        if "threads" in cfg.options:
            torch.set_num_threads(threads_option(cfg.options))
        if torch.device(cfg.device).type == "cpu" and cfg.options.get("keep_freed_memory", True):
            keep_freed_memory()
        self.device = torch.device(cfg.device)
        self.arch = model.arch
        self.compute = _compute_dtype(cfg.options, model.dtype)
        self.model = build_model(self.arch, self.compute, self.device, model.source.floats,
                                 model.source.seed)
        self.dtype = model.dtype           # the pool's, as the other phase's backend reads it
        self.use_graphs = self.device.type == "cuda" and bool(cfg.options.get("cuda_graphs", True))

    def compute_dtype(self, phase: str) -> torch.dtype | None:
        return self.compute if self.compute != self.dtype else None

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVHeads.of(self.arch).spec(len(self.arch.attention_layers), self.dtype, self.device,
                                          scratch_blocks=1 if self.use_graphs else 0)

    def bind_kv_cache(self, kv: KVCache) -> None:
        self.kv = kv
        self.groups = kv.groups if kv.groups is not None and kv.groups.num_groups > 1 else None
        if self.groups is not None and self.use_graphs:
            log.info("torch: decode runs without CUDA graphs over a pool in %d groups",
                     self.groups.num_groups)
            self.use_graphs = False
        if kv.states and self.use_graphs:
            log.info("torch: decode runs without CUDA graphs for a model with state layers")
            self.use_graphs = False
        if self.use_graphs:
            from twophase.backends.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self._forward_decode, kv)

    # -- adapters ---------------------------------------------------------------------------
    def place_adapter(self, slot: int, adapter: Any) -> None:
        """The projections are wrapped at the first adapter (a model never given one runs as it
        was); CUDA graphs, captured without adapters, are given up then."""
        from twophase.lora.layer import attach, place

        if self.lora is None:
            self.lora = attach(self.model)
            if self.graphs is not None:
                log.info("torch: decode runs without CUDA graphs once adapters are served")
                self.graphs = None
        place(self.lora[1], slot, adapter, self.device, self.compute)

    def _adapters(self, slots: list[int] | None, lens: list[int]) -> None:
        """Which tokens of this call run with which adapter slot."""
        if self.lora is not None:
            if slots is None:
                self.lora[0].clear()
            else:
                self.lora[0].set([s for s, n in zip(slots, lens) for _ in range(n)], self.device)

    # -- the two operations -----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        self.kv.copy_states(batch.state_copies)
        self._adapters(batch.lora_slots, batch.query_lens)
        meta = self._meta(batch)
        dev = self.device
        spans = list(zip(batch.query_start[:-1], batch.query_lens, batch.start_positions))
        hidden = self.model(batch.token_ids.to(dev), batch.positions.to(dev), self.kv.pool, meta,
                            self.groups, self.kv.states, state_meta(batch.state_slots, spans))
        if batch.logits == "last":
            last = torch.tensor(batch.query_start[1:], device=dev) - 1
            hidden = hidden[last]
        if batch.output == "hidden":        # the decoder's output is after the final norm
            return hidden
        return self.model.logits(hidden)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        self.kv.copy_states(batch.state_copies)
        self._adapters(batch.lora_slots, [1] * batch.num_seqs)
        if self.graphs is not None:
            return self.graphs.run(batch)
        dev = self.device
        states = state_meta(batch.state_slots, [(i, 1, p) for i, p in enumerate(batch.positions.tolist())])
        return self._forward_decode(batch.token_ids.to(dev), batch.positions.to(dev),
                                    batch.slot_mapping.to(dev), batch.block_tables.to(dev),
                                    batch.context_lens.to(dev), states)

    def _forward_decode(self, tokens, positions, slots, tables, lens, states: StateMeta | None = None) -> torch.Tensor:
        """One token per sequence, all tensors on the device: the body a CUDA graph captures."""
        idx = torch.arange(tokens.shape[0], device=tokens.device)
        meta: AttnMeta | list[AttnMeta] = AttnMeta(slots, idx, tables, lens, [])
        if self.groups is not None:
            meta = [AttnMeta(s, idx, t, lens, []) for s, t in zip(slots, tables)]
        return self.model.logits(self.model(tokens, positions, self.kv.pool, meta, self.groups,
                                            self.kv.states, states))

    def _meta(self, batch: PrefillBatch) -> AttnMeta | list[AttnMeta]:
        if self.groups is None:
            return self._group_meta(batch, batch.slot_mapping, batch.block_tables)
        return [self._group_meta(batch, s, t) for s, t in zip(batch.slot_mapping, batch.block_tables)]

    def _group_meta(self, batch: PrefillBatch, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor) -> AttnMeta:
        dev, bs = self.device, self.kv.block_size
        ctx = batch.context_lens.tolist()
        dec = [i for i, n in enumerate(batch.query_lens) if n == 1]
        decode_idx = decode_tables = decode_lens = None
        if dec:
            width = -(-max(ctx[i] for i in dec) // bs)
            idx = torch.tensor(dec)
            decode_idx = (torch.tensor(batch.query_start[:-1])[idx]).to(dev)
            decode_tables = block_tables[idx, :width].to(dev)
            decode_lens = batch.context_lens[idx].to(dev)
        chunks = []
        starts = batch.query_start
        for i, n in enumerate(batch.query_lens):
            if n > 1:
                table = block_tables[i, :-(-ctx[i] // bs)].to(dev)
                chunks.append((starts[i], n, batch.start_positions[i], table))
        return AttnMeta(slot_mapping.to(dev), decode_idx, decode_tables, decode_lens, chunks)


def state_meta(slots: torch.Tensor | None, spans: list[tuple[int, int, int]]) -> StateMeta | None:
    """Each sequence's state slot and tokens (None where the model keeps no state)."""
    return None if slots is None else StateMeta(slots.tolist(), spans)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory in the heap instead of returning large blocks to the OS.

    By default every freed block above a few MiB is unmapped, so the next step's equally large
    temporaries (the gathered KV blocks, tens of MB at batch 64) fault in fresh zeroed pages:
    measured here, that doubled the time of a decode step at batch 64 (1.18 s -> 0.50 s with
    this). A process-wide allocator setting, like ``torch.set_num_threads``; turn it off with
    ``[backend.options] keep_freed_memory = false``."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:          # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [TorchBackend]


def _compute_dtype(options: dict[str, Any], model_dtype: torch.dtype) -> torch.dtype:
    """Option ``compute_dtype`` (default: the model's), named if it is not a dtype torch computes in."""
    name = options.get("compute_dtype")
    if name is None:
        return model_dtype
    if name not in COMPUTE_DTYPES:
        raise ConfigError("backend.options.compute_dtype",
                          f"must be one of {', '.join(COMPUTE_DTYPES)}; got {name!r}")
    return COMPUTE_DTYPES[name]
