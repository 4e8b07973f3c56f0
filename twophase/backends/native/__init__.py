"""The native backend: a whole forward step in one C function (``step.c``, compiled at first
use), on the GGUF's blocks as they are, for the CPU, for every dense family of the layers kit
(the departures from the Llama block are fields of ``step.c``'s ``model_t``; experts run from
a GGUF file's blocks, ``quantization = "gguf"``).

Why: decode at small batches is latency-bound, and a graph of library operators pays a dispatch
for each of its ~1,900 ops (about 2 µs each in ONNX Runtime); here each op of a layer costs one
barrier between two OpenMP threads. It runs ``quantization = "q4"``, with the ONNX path's
quality rewrites (centred zero points, outlier channels in float32; ``twophase.exporters.q4``),
and ``"gguf"``: every tensor in the block type the file stores it in (``gguf_blocks.h``).
Prefill runs the same tiles as decode (2 weight rows by 4 tokens, 64 tokens a pass over the
weights); ``benchmarks/quantized.py`` compares it with onnxruntime's on a machine, and
``[backend.prefill]``/``[backend.decode]`` route each phase to the faster one. The blocks' layout
and the kernels are described in ``docs/quantization.md``.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import torch

from twophase import large_pages
from twophase.arch import ModelArch
from twophase.backends.hookspecs import hookimpl
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
    KVGroups,
    MemoryQuery,
    ModelSpec,
    PrefillBatch,
    parse_device,
)
from twophase.device import cpu_flags, threads_option
from twophase.errors import ConfigError
from twophase.kv_formats import KV_FORMATS
from twophase.measure.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)

OPTIONS = {"threads", "isa", "share_cpu", "amx"}
AMX_ROWS = 24     # a step's rows from which the tiles beat the int8 paths (benchmarks/amx_crossover.py)
# amx_request()'s answers other than 1 (tiles in use)
AMX_OFF = {0: "this build has no AMX (the CPU, the compiler or backend.options.isa lacks it)",
           -1: "the Linux kernel refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"}
LOGIT_BUFFERS = 4      # kept for reuse: a step calls a backend once or twice (prefill, decode)
LOGIT_BUFFER_BYTES = 64 << 20   # the largest kept (a batch of 64 of a 262144-token vocabulary)
# every departure of the families from the Llama block (``model_t``'s fields; experts on the
# GGUF's stored blocks only). Named one by one, never derived from ``twophase.arch.FEATURES``: a
# feature added there is refused until step.c computes it and this list names it.
NATIVE_FEATURES = frozenset({
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "post_norms", "gelu_tanh", "embed_scale",
    "attn_softcap", "final_softcap", "query_scale", "partial_rotary", "rope_per_layer", "sliding_window", "moe",
    "rope_yarn", "attn_sinks", "moe_bias", "clamped_swiglu",
})
# the formats step.c reads, in the order of its kv_type (KV_F32, KV_F16, KV_BF16, KV_Q8); not
# fp8, which a CPU converts in software only
KV_READS = ("float32", "float16", "bfloat16", "int8")
KV_TYPES = {KV_FORMATS[n].storage: i for i, n in enumerate(KV_READS)}


class NativeBackend(Backend):
    name = "native"
    contract_version = CONTRACT_VERSION
    quantizations = ("q4", "gguf")

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        if parse_device(device).type != "cpu":
            raise BackendUnavailable(f"device {device!r}: the native backend runs on the cpu")
        from twophase.backends.native.kernel import check_machine

        check_machine()

    @classmethod
    def memory(cls, query: MemoryQuery) -> BackendMemory:
        """The GGUF's blocks as they are; its float32 embedding stays mapped from the packed
        file, so only the rows of tokens seen are ever read in."""
        return BackendMemory(layout="stored" if query.quantization == "gguf" else "blocks", mapped_embedding=True)

    def capabilities(self) -> Capabilities:
        # step.c computes every departure of the families from the Llama block (experts on the
        # GGUF's stored blocks only), and reads a pool in groups (a sliding group's blocks freed
        # as its window passes them)
        return Capabilities(devices=("cpu",), dtypes=(torch.float32,), own_threads=True,
                            features=NATIVE_FEATURES, kv_formats=KV_READS, kv_groups=True,
                            features_on={"q4": NATIVE_FEATURES - {"moe"}})

    def supports(self, arch: ModelArch) -> str | None:
        """Also the shapes ``step.c`` does not tile: query heads that do not group over the KV
        heads, widths not whole blocks of 32, MLP widths that change from layer to layer."""
        why = [r.removeprefix("native: ") for r in [super().supports(arch)] if r]
        if len({s.mlp.intermediate_size for s in arch.layers}) > 1:
            why.append("an MLP width that changes from layer to layer is not implemented")
        if len({s.mlp.num_experts for s in arch.layers}) > 1:
            why.append("layers that mix dense and expert MLPs are not implemented")
        if any(s.mlp.num_experts and not 0 < s.mlp.top_k <= s.mlp.num_experts for s in arch.layers):
            why.append("a top k outside 1 to the number of experts is not implemented")
        if arch.num_heads % arch.num_kv_heads:
            why.append(f"{arch.num_heads} query heads over {arch.num_kv_heads} KV heads is not implemented")
        if arch.hidden_size % 32 or (arch.num_heads * arch.head_dim) % 32 \
                or any(s.mlp.intermediate_size % 32 for s in arch.layers):
            why.append("hidden, heads x head_dim or intermediate sizes that are not multiples of 32 "
                       "are not implemented")
        return f"native: {'; '.join(why)}" if why else None

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(OPTIONS)
        threads = threads_option(cfg.options)
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the native backend runs float32, not {model.dtype}")
        self.arch = model.arch
        from twophase.backends.native import kernel
        from twophase.backends.native.model_struct import NativeWeights

        isa = cfg.options.get("isa", "native")
        if not isinstance(isa, str) or isa not in kernel.ISA_FLAGS:
            raise ConfigError("backend.options.isa", f"the native kernels' instruction set is one of "
                              f"{', '.join(map(repr, kernel.ISA_FLAGS))}; got {isa!r}")
        self.lib = kernel.load(kernel.ISA_FLAGS[isa])
        self.isa = kernel.ISA_NAMES[self.lib.kernel_isa()]
        log.info("native kernels: %s, %d threads", self.isa, threads)
        self.threads = threads
        share = cfg.options.get("share_cpu", True)
        if not isinstance(share, bool):
            raise ConfigError("backend.options.share_cpu", f"must be true or false; got {share!r}")
        self.governor = ThreadGovernor(threads, name="native") if share and threads > 1 else None
        self.weights = NativeWeights.build(model)
        self.amx = self._amx(cfg.options.get("amx", True), model.quantization)   # rows from which; 0 never
        self.tiled_projections = bool(self.amx) and model.quantization == "gguf"
        self.scratch = torch.empty(0)
        self.logit_buffers: list[np.ndarray] = []

    def _amx(self, want: object, quantization: str) -> int:
        """Steps of this many rows or more (0: none) take AMX bf16 tiles: a prompt chunk of as
        many rows attends on them (amx_attention.h), and the stored formats' projections run on
        them (amx_tiles.h; q4's keep the int8 dots). Where asked (true: from AMX_ROWS; a number:
        from that many), the build has them and Linux lends the tile state; else the vector
        paths, said."""
        if not (isinstance(want, bool) or isinstance(want, int) and want >= 1):
            raise ConfigError("backend.options.amx", f"must be true, false or a number of rows (1 or "
                              f"more) from which a step takes the tiles; got {want!r}")
        if want is False:
            return 0
        rows = AMX_ROWS if want is True else int(want)
        got = self.lib.amx_request()
        if got == 1:
            attends = self.arch.head_dim % 32 == 0      # the tiles take rows of 32 values
            log.info("native prefill: AMX bf16 tiles for steps of %d tokens or more (%s)", rows,
                     ("projections" if quantization == "gguf" else f"no projections: {quantization!r} keeps int8 dots")
                     + ("; prompt chunks' attention" if attends else
                        f"; attention on the vector path (head_dim {self.arch.head_dim} is no multiple of 32)"))
        else:
            log.info("native prefill: no AMX tiles, %s", AMX_OFF.get(got, f"answer {got}"))
        return rows if got == 1 else 0

    @classmethod
    def engines_here(cls, device: str = "cpu") -> str | None:
        flags = cpu_flags()
        dots = ("AVX-512 VNNI" if {"avx512f", "avx512_vnni"} <= flags else
                "AVX-VNNI" if "avx_vnni" in flags else "AVX2") + " int8 dots"
        if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
            return f"{dots}; steps of {AMX_ROWS}+ tokens on AMX bf16 tiles (attention; gguf's projections)"
        return dots

    def compute_dtype(self, phase: str) -> torch.dtype | None:
        """bf16 tiles for a prefill where AMX takes its projections (a long one, on the stored
        formats), else int8 dots (the roof a decode is read against, though with the stored
        formats a decode batch of ``self.amx`` sequences or more runs its projections on the
        tiles too)."""
        return torch.bfloat16 if phase == "prefill" and self.tiled_projections else torch.int8

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))

    def bind_kv_cache(self, kv: KVCache) -> None:
        if kv.pool.dtype not in KV_TYPES or not kv.pool.is_contiguous():
            raise ConfigError("cache.dtype", f"the native backend reads a contiguous pool of "
                              f"{', '.join(KV_READS)}, not {kv.pool.dtype}")
        self.kv = kv
        groups = kv.groups or KVGroups.plain(self.arch.num_layers)
        self.slot_group = np.array([groups.slot, groups.group], np.int32)    # what step.c points into
        self.weights.model.slot = self.slot_group[0].ctypes.data
        self.weights.model.group = self.slot_group[1].ctypes.data

    # -- the two operations -----------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        starts = batch.query_start
        seq = torch.repeat_interleave(torch.arange(batch.num_seqs, dtype=torch.int32),
                                      torch.tensor(batch.query_lens))
        if batch.logits == "all":
            rows = torch.arange(batch.num_tokens, dtype=torch.int32)
        else:
            rows = torch.tensor(starts[1:], dtype=torch.int32) - 1
        return self._step(batch.token_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                          seq, rows)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        rows = torch.arange(batch.num_seqs, dtype=torch.int32)
        return self._step(batch.token_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                          rows, rows)

    def _step(self, tokens, positions, slots, tables, seq, logit_rows) -> torch.Tensor:
        from twophase.backends.native.kernel import Step

        tokens, positions, slots = (t.to(torch.int64).contiguous() for t in (tokens, positions, slots))
        tables = tables.to(torch.int64).contiguous()      # [B, nb], or [G, B, nb] in groups
        ctx = (positions + 1).to(torch.int32)
        max_ctx = int(ctx.max())
        groups = self.kv.groups.num_groups if self.kv.groups else 1
        if slots.dim() != 1 + (groups > 1) or tables.dim() != 2 + (groups > 1):
            raise ValueError(f"slot mapping and block tables for {groups} groups of layers")
        if tables.shape[-1] * self.kv.block_size < max_ctx:
            raise ValueError(f"block tables of width {tables.shape[-1]} for {max_ctx} tokens")
        pool = self.kv.pool
        slots_in_pool = pool.shape[2] * pool.shape[4]
        if int(slots.min()) < 0 or int(slots.max()) >= slots_in_pool or int(tables.min()) < 0 \
                or int(tables.max()) >= pool.shape[2]:
            raise ValueError("slots or block ids outside the pool")     # C would write past it
        rows, n_logits = tokens.shape[0], logit_rows.shape[0]
        need = self.lib.step_scratch_floats(self.weights.model, rows, max_ctx, self.threads)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(int(need * 1.25) + 1024, dtype=torch.float32)
        logits = self._logits(n_logits)
        s = Step(rows=rows, tokens=tokens.data_ptr(), positions=positions.data_ptr(), slots=slots.data_ptr(),
                 tables=tables.data_ptr(), width=tables.shape[-1], seqs=tables.shape[-2], seq=seq.data_ptr(),
                 ctx=ctx.data_ptr(), n_logits=n_logits, logit_rows=logit_rows.data_ptr(), pool=pool.data_ptr(),
                 num_blocks=pool.shape[2], block_size=pool.shape[4], kv_type=KV_TYPES[pool.dtype],
                 logits=logits.data_ptr(), scratch=self.scratch.data_ptr(), max_ctx=max_ctx, threads=self.threads,
                 team=self.governor.threads() if self.governor is not None else self.threads, amx=self.amx)
        self.lib.step(self.weights.model, s)     # the tensors above outlive the call
        return logits

    def _logits(self, rows: int) -> torch.Tensor:
        """A [rows, vocab] float32 tensor for a step's logits, on a buffer no earlier result
        still holds. A fresh one each step can cost its pages' first touch: 32 rows of Gemma's
        262144 logits are 33.5 MB, past what glibc keeps for reuse (32 MB); the cost is in
        docs/measurements.md. A buffer is free when nothing but it refers to its
        memory's array (a returned tensor, and any view of it, holds that array: numpy's views
        all point at it)."""
        need, kept = rows * self.arch.vocab_size, self.logit_buffers
        free = [i for i, buf in enumerate(kept) if sys.getrefcount(buf.base) == 2]   # buf's, the argument
        fits = [i for i in free if kept[i].size >= need]
        if fits:
            return self._logits_in(kept[fits[0]], rows)
        if 4 * need > LOGIT_BUFFER_BYTES or (len(kept) == LOGIT_BUFFERS and not free):
            return torch.empty(rows, self.arch.vocab_size, dtype=torch.float32)   # not kept
        buf = large_pages.region(4 * need).view(np.float32)
        if len(kept) < LOGIT_BUFFERS:
            kept.append(buf)
        else:                                   # a batch grew: its buffer replaces the smallest free one
            kept[min(free, key=lambda i: kept[i].size)] = buf
        return self._logits_in(buf, rows)

    def _logits_in(self, buf: np.ndarray, rows: int) -> torch.Tensor:
        return torch.from_numpy(buf[:rows * self.arch.vocab_size]).view(rows, self.arch.vocab_size)


@hookimpl
def twophase_backends() -> list[type[Backend]]:
    return [NativeBackend]

