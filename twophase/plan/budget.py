"""What eats the memory: a config's budget on a device, item by item, from shapes alone.

The engine sizes its KV pool with the same functions (``pool_blocks``), so the plan made before
loading is the pool the engine allocates. Items:

- ``weights``: per backend that holds them, per tensor group, in the layout it holds
  (``twophase.plan.weight_layouts``), as many copies as it says (``Backend.memory``: ONNX Runtime on
  the CPU holds one in each of its graphs).
- ``activations``: the peak of one step at the engine's limits (the token budget's prefill, or
  ``max_num_seqs`` decodes whose context is padded to ``max_model_len``, whichever is larger),
  unless every phase's backend holds its activations in a workspace of its own.
- ``logits``: ``max_num_seqs × vocab × 4 B``, ``× (k+1)`` with ``k`` speculative drafts.
- ``cuda graphs``: captured decode steps, for a backend that captures them (torch on CUDA):
  their private pool holds the largest bucket's activations and every bucket's logits.
- ``workspace``: what a backend sizes itself (TensorRT's profiles); cuBLAS's on CUDA.
- ``adapters``: the ``[[lora]]`` adapters that can be resident at once (the ``model.max_loras``
  largest), float32 as they are held.
- ``runtime``: the CUDA context and libraries, or the Python process on the CPU.
- ``reserve``: what the engine leaves free (``1 - cache.memory_utilization`` of a GPU; on the CPU
  all but the pool's share of the free memory).
- ``kv cache``: the rest, in whole blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from twophase.arch import ModelArch
from twophase.backends.registry import Registry
from twophase.cache import layout
from twophase.cache.layout import KVHeads, PoolLayout, PoolSettings, lay_out_pool, model_len, pool_groups
from twophase.cache.spec import attention_spec
from twophase.config import BackendSection, Config
from twophase.contract import BackendMemory, Capabilities, EngineLimits, KVGroups, MemoryQuery
from twophase.errors import ConfigError
from twophase.kv_formats import kv_format
from twophase.plan import weight_layouts as layouts
from twophase.plan.devices import DeviceProfile
from twophase.plan.model_source import PlannedModel, planned_model

GiB, MiB = 1 << 30, 1 << 20
AUTO_MAX_DRAFTS = 6                 # the most drafts num_tokens = "auto" gives a decode
CUDA_RUNTIME = 512 * MiB            # CUDA context, cuBLAS/cuDNN handles and kernels loaded
CUBLAS_WORKSPACE = 32 * MiB
CPU_RUNTIME = 300 * MiB             # Python, torch, libraries (~220 MiB); the first model's threads, kernels
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Item:
    kind: str           # weights, kv cache, activations, logits, cuda graphs, workspace, runtime, reserve
    name: str
    bytes: int
    how: str            # how it was counted, in a few words
    resident: bool = True    # at load; else mapped from a file and paged in as it is used
    # what the engine's check of the plan does with it: "" held from load on; "draft" the draft
    # model's, loaded after the pool; "at bind" allocated when the pool is bound (TensorRT's profiles)
    role: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "bytes": self.bytes, "how": self.how,
                "resident": self.resident}


@dataclass
class Plan:
    model: PlannedModel
    device: DeviceProfile
    items: list[Item]
    pool: PoolLayout                    # the pool's layout (``twophase.cache.layout``)
    context: int                        # the context the concurrency figures are for
    users: int | None
    notes: list[str] = field(default_factory=list)
    draft_bytes_per_block: int = 0      # a draft model's pool, block for block beside the target's

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def max_model_len(self) -> int:
        """What one request may use as the model and config allow (the pool may hold less)."""
        return self.pool.model_len

    @property
    def kv_bytes_per_token(self) -> int:
        """A token's K/V in every layer."""
        return len(self.pool.groups.group) * self.pool.slot_bytes_per_token

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.pool.windows

    @property
    def kv_tokens(self) -> int:
        """The longest context one sequence may have in the pool."""
        return self.pool.kv_tokens

    def concurrency(self, context: int) -> int:
        """Sequences of ``context`` tokens the pool holds at once."""
        return self.pool.concurrency(context)

    def full_attention_concurrency(self, context: int) -> int:
        """Sequences of ``context`` tokens the same memory (blocks and state slots) would hold
        if every layer kept K/V as the attention layers do: what the state layers buy."""
        per_layer = self.pool.slot_bytes_per_token
        each = -(-context // self.block_size) * self.block_size * per_layer * self.model.arch.num_layers
        return (self.num_blocks * self.pool.page_bytes + self.pool.state_bytes) // each

    def sequence_kv_bytes(self, context: int) -> int:
        """The K/V one sequence of ``context`` tokens holds once it is in (a sliding layer's
        window's, a full layer's every token)."""
        return self.pool.sequence_bytes(context)

    @property
    def fits(self) -> bool:
        """Something fits: at least one block, and nothing over the device."""
        return self.num_blocks > 0 and self.total() - self.total("reserve") <= self.device.total_bytes

    def total(self, kind: str | None = None, resident: bool = False) -> int:
        """Bytes of the items of ``kind`` (all items if None); only those resident from load on
        if ``resident``."""
        return sum(i.bytes for i in self.items if (kind is None or i.kind == kind)
                   and (i.resident or not resident))

    def active_weights(self) -> tuple[int, int] | None:
        """A mixture of experts' weight bytes one token reads, and those held: each group's
        weight items scaled by the share of its parameters a token multiplies (None: no experts)."""
        from twophase.models import param_counts

        arch = self.model.arch
        if not any(s.mlp.num_experts for s in arch.layers):
            return None
        total, active = param_counts.group_params(arch), param_counts.active_group_params(arch)
        weights = [(i.bytes, i.name.split(" ")[0]) for i in self.items if i.kind == "weights"]
        read = sum(b * active[g] / total[g] for b, g in weights if total.get(g))
        return int(read), sum(b for b, _ in weights)

    def to_dict(self) -> dict:
        conc = self.concurrency(self.context)
        out = {"model": self.model.model_id, "model_source": self.model.source,
               "device": self.device.name, "device_bytes": self.device.total_bytes,
               "items": [i.to_dict() for i in self.items],
               "totals": {k: self.total(k) for k in dict.fromkeys(i.kind for i in self.items)},
               "kv_bytes_per_token": self.kv_bytes_per_token, "block_size": self.block_size,
               "num_blocks": self.num_blocks, "kv_tokens": self.kv_tokens,
               "max_model_len": self.max_model_len, "context": self.context,
               "max_concurrency": conc, "sequence_kv_bytes": self.sequence_kv_bytes(self.context),
               "kv_groups": len(self.windows), "fits": self.fits, "notes": self.notes}
        if self.pool.state is not None:
            out |= {"state_bytes_per_sequence": self.pool.state.bytes_per_sequence(),
                    "state_layers": self.pool.state.num_layers, "state_slots": self.pool.state_slots,
                    "full_attention_concurrency": self.full_attention_concurrency(self.context)}
        if (active := self.active_weights()) is not None:
            out |= {"active_weight_bytes": active[0]}
        if self.users is not None:
            out |= {"users": self.users, "users_fit": self.users <= conc,
                    "users_waiting": max(0, self.users - conc)}
        return out


def kv_dtype_bytes(config: Config, device_kind: str, arch: ModelArch) -> float:
    """Bytes the pool holds a K or V value in (``cache.dtype``; int8 counts its scales)."""
    name = config.cache.dtype if config.cache.dtype != "auto" else model_dtype(config, device_kind)
    return kv_format(name).bytes_per_value(arch.head_dim)


def model_dtype(config: Config, device_kind: str) -> str:
    d = config.model.dtype
    return d if d != "auto" else ("bfloat16" if device_kind == "cuda" else "float32")


def pool_settings(config: Config, device_kind: str, format: str | None = None) -> PoolSettings:
    """What ``config`` asks of the pool and a step (``format``: the K/V format the backends keep;
    by default ``cache.dtype``, or the model's dtype)."""
    cc, sc = config.cache, config.scheduler
    if format is None:
        format = cc.dtype if cc.dtype != "auto" else model_dtype(config, device_kind)
    snapshots = 0
    if cc.prefix_caching and not config.cluster.disaggregated:
        snapshots = 2 * sc.max_num_seqs if cc.state_snapshots == "auto" else int(cc.state_snapshots)
    return PoolSettings(cc.block_size, None if cc.num_blocks == "auto" else int(cc.num_blocks),
                        None if cc.memory_gb is None else int(cc.memory_gb * GiB), format, sc.max_num_seqs,
                        sc.max_num_batched_tokens, sc.chunked_prefill, config.model.max_model_len, device_kind,
                        snapshots, config.speculative.method != "none")


def token_budget(config: Config, device_kind: str, max_model_len: int) -> int:
    """Tokens one step may compute: the config's, else 4096 on CUDA and 512 on the CPU with
    chunked prefill, else a whole context."""
    return layout.token_budget(pool_settings(config, device_kind, "float32"), max_model_len,
                               config.scheduler.chunked_prefill)


def backend_memory(registry: Registry, sec: BackendSection, config: Config, arch: ModelArch, device_kind: str,
                   max_model_len: int) -> BackendMemory:
    """What ``sec``'s backend says it holds (``Backend.memory``) for this config at its limits."""
    cc, sc = config.cache, config.scheduler
    blocks = int(cc.num_blocks) if cc.num_blocks != "auto" else sc.max_num_seqs * -(-max_model_len // cc.block_size)
    limits = EngineLimits(sc.max_num_seqs, token_budget(config, device_kind, max_model_len), max_model_len)
    query = MemoryQuery(arch, model_dtype(config, device_kind), config.model.quantization, device_kind,
                        sec.options, limits, blocks, cc.block_size)
    return registry.get(sec.name).memory(query)


def weight_groups(layout: str, config: Config, model: PlannedModel, dtype: str) -> tuple[dict[str, int], str]:
    """Bytes per tensor group in ``layout`` (``BackendMemory.layout``), and its name."""
    if layout == "stored":
        if model.stored is None:
            raise ConfigError("model.quantization", f'"gguf" runs the tensors of a GGUF file as it stores '
                              f'them; {model.model_id} was not loaded from one (use "q4" to quantise it)')
        arch = model.arch
        return ({**model.stored, "embedding": arch.vocab_size * arch.hidden_size * 4},
                "as the GGUF stores them; the embedding float32")
    if layout == "blocks":
        return layouts.blocks(model.arch, config.model.outlier_channels, model.head_bits), "q4 blocks"
    if layout == "matmulnbits":
        return layouts.matmulnbits(model.arch, config.model.outlier_channels, model.head_bits), "MatMulNBits q4"
    return layouts.dense(model.arch, DTYPE_BYTES[dtype]), dtype


def weight_items(config: Config, model: PlannedModel, device_kind: str, registry: Registry, max_model_len: int,
                 routed: tuple[str, ...] = ()) -> list[Item]:
    """Each distinct backend's copy of the weights, per group (``routed``: backends that decode
    small batches beside the phases', ``[backend] name = "auto"``)."""
    pcfg, dcfg = config.phases()
    sections = [pcfg] if (pcfg.name, pcfg.options) == (dcfg.name, dcfg.options) else [pcfg, dcfg]
    sections += [BackendSection(name=n, device=dcfg.device) for n in dict.fromkeys(routed)
                 if n not in {s.name for s in sections}]
    dtype, arch = model_dtype(config, device_kind), model.arch
    items = []
    for sec in sections:
        mem = backend_memory(registry, sec, config, arch, device_kind, max_model_len)
        groups, how = weight_groups(mem.layout, config, model, mem.dtype or dtype)
        if mem.tied_head_apart and arch.tie_word_embeddings:
            groups["head"] = groups["embedding"]
            how += ", tied head prepacked apart"
        copies, mapped = mem.weight_copies, mem.mapped_embedding
        label = f"{sec.name}" + (f" ×{copies} graphs" if copies > 1 else "")
        items += [Item("weights", f"{g} ({label})", n * copies,
                       how + (", mapped: rows resident as used" if mapped and g == "embedding" else ""),
                       resident=not (mapped and g == "embedding"))
                  for g, n in groups.items() if n]
    return items


def activation_peak(arch: ModelArch, tokens: int, seqs: int, context: int, e: int) -> tuple[int, str]:
    """The larger of a prefill step of ``tokens`` (the MLP's ``2f`` and ``f`` wide temporaries,
    or q/k/v with float32 RoPE, the context's K/V gathered twice and its mask) and a decode step
    of ``seqs`` sequences padded to ``context`` (their K/V gathered and float32 scores, a slice
    of sequences at a time: ``twophase.models.layers.attention.decode_rows``)."""
    from twophase.models.layers.attention import decode_rows

    h, H, KV, hd = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    f = max(s.mlp.intermediate_size for s in arch.layers)     # the widest layer's MLP
    T, C, B = tokens, context, seqs
    mlp = 4 * T * f * e
    attn = T * (H + 2 * KV) * hd * e + 2 * T * H * hd * 4 + T * H * hd * e + 4 * C * KV * hd * e + T * C
    if arch.attn_softcap is not None:       # soft-capped scores are materialised: [H, T, C] float32, thrice
        attn += 3 * H * T * C * 4
    prefill = 2 * T * h * e + max(mlp, attn)
    rows = decode_rows(B, C, KV, hd, e)
    decode = 2 * B * h * e + rows * (2 * C * KV * hd * e + 3 * H * C * 4) + (B * H * hd * e if rows < B else 0)
    if prefill >= decode:
        return prefill, f"prefill of {T} tokens"
    return decode, f"{B} decodes padded to {C} tokens, {rows} at a time"


def runtime_items(config: Config, model: PlannedModel, device: DeviceProfile, max_model_len: int,
                  registry: Registry) -> list[Item]:
    """Everything but the weights and the pool, at the engine's limits."""
    arch, kind = model.arch, device.kind
    e = DTYPE_BYTES[model_dtype(config, kind)]
    sc, sp = config.scheduler, config.speculative
    T = token_budget(config, kind, max_model_len)
    act, how = activation_peak(arch, T, sc.max_num_seqs, max_model_len, e)
    k = 0 if sp.method == "none" else (AUTO_MAX_DRAFTS if sp.num_tokens == "auto" else int(sp.num_tokens))
    logits = sc.max_num_seqs * arch.vocab_size * 4 * (k + 1)
    mems = [backend_memory(registry, s, config, arch, kind, max_model_len) for s in config.phases()]
    items = [Item("activations", "one step's peak", act, how)] if any(m.step_activations for m in mems) else []
    items.append(Item("logits", "logits of a step", logits,
                      f"{sc.max_num_seqs} seqs × {arch.vocab_size} × 4 B" + (f" × {k + 1}" if k else "")))
    if kind == "cuda":
        items.append(Item("runtime", "CUDA context and libraries", CUDA_RUNTIME, "typical, CUDA 12"))
        items.append(Item("workspace", "cuBLAS", CUBLAS_WORKSPACE, "one stream"))
    else:
        items.append(Item("runtime", "Python, torch and libraries", CPU_RUNTIME,
                          "measured: imports, the first model's threads"))
    if any(m.cuda_graphs for m in mems):
        items.append(cuda_graph_item(arch, sc.max_num_seqs, max_model_len, config.cache.block_size, e))
    if config.lora:
        items.append(adapter_item(config))
    # a backend that runs both phases holds its workspace once
    spaces = dict.fromkeys(m.workspace for m in mems if m.workspace is not None)
    items += [Item("workspace", w.name, w.bytes, w.how, role="at bind") for w in spaces]
    return items


def adapter_item(config: Config) -> Item:
    """The largest ``max_loras`` of the config's adapters, as held (float32); one that cannot be
    read counts nothing here (loading it reports why)."""
    from twophase.lora.peft_adapter import adapter_bytes

    sizes = sorted((adapter_bytes(config.resolve(a.path)) for a in config.lora), reverse=True)
    k = min(config.model.max_loras, len(sizes))
    return Item("adapters", "resident LoRA adapters", sum(sizes[:k]),
                f"the largest {k} of {len(sizes)}, float32")


def cuda_graph_item(arch: ModelArch, seqs: int, context: int, block_size: int, e: int) -> Item:
    """The captured decode steps' pool: the largest bucket's activations, and the logits each
    (batch, context-blocks) bucket keeps as its output."""
    pow2 = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    B, nb = pow2(seqs), pow2(-(-context // block_size))
    act, _ = activation_peak(arch, 0, B, nb * block_size, e)
    batches = [1 << i for i in range(B.bit_length())]
    contexts = nb.bit_length()
    logits = sum(batches) * contexts * arch.vocab_size * 4
    return Item("cuda graphs", "captured decode steps", act + logits,
                f"{len(batches)} batch × {contexts} context buckets")


def plan(config: Config, device: DeviceProfile, context: int | None = None, users: int | None = None,
         model: PlannedModel | None = None, routed: tuple[str, ...] = (), registry: Registry | None = None) -> Plan:
    """``config``'s budget on ``device``, item by item; each backend's share as it says
    (``Backend.memory``, the classes found in ``registry``: the installed ones if None)."""
    registry = registry if registry is not None else Registry()
    model = model or planned_model(config.model)
    arch, kind, cc = model.arch, device.kind, config.cache
    settings = pool_settings(config, kind)
    max_len = model_len(arch, settings)
    items = (weight_items(config, model, kind, registry, max_len, routed)
             + runtime_items(config, model, device, max_len, registry))
    draft_items, draft_block = draft_model(config, kind, registry)
    items += draft_items
    used = sum(i.bytes for i in items)
    reserve = int((1 - cc.memory_utilization) * device.total_bytes) if kind == "cuda" else 0
    prefill, decode = phase_capabilities(config, registry)
    # the index limit counts a scratch block, as CUDA graphs keep one
    pool = lay_out_pool(arch, settings, prefill, [decode], max(0, device.total_bytes - used - reserve),
                        may_group=not config.cluster.disaggregated, scratch_blocks=1,
                        extra_bytes_per_block=draft_block)
    blocks, per_block = pool.num_blocks, pool.page_bytes + draft_block
    notes: list[str] = []
    if pool.at_backend_limit:
        notes.append(f"the pool stops at {blocks} blocks: the most a backend of this config "
                     f"can index (Capabilities.max_pool_elements)")
    if kind == "cpu":
        reserve = max(0, device.total_bytes - used - blocks * per_block - pool.state_bytes)
    items.append(Item("kv cache", "KV pool", blocks * pool.page_bytes, f"{blocks} blocks × {cc.block_size} tokens"))
    if pool.state is not None:
        items.append(Item("kv cache", "state slots", pool.state_bytes,
                          f"({pool.running_slots} running"
                          + (f" + {pool.running_slots} before a verify" if pool.state_verify_rows else "")
                          + f" + {pool.state_snapshots} snapshots) × {pool.state.bytes_per_sequence() / MiB:.2f} MiB"))
    if draft_block:
        items.append(Item("kv cache", "draft model's KV pool", blocks * draft_block,
                          f"{blocks} blocks, as the target's", role="draft"))
    items += [Item("reserve", "left free", reserve,
                   f"1 - cache.memory_utilization ({cc.memory_utilization})" if kind == "cuda"
                   else "the system's: the CPU pool takes at most a quarter of free memory, 2 GiB")]
    over = sum(i.bytes for i in items) - device.total_bytes
    if over > 0:
        notes.append(f"does not fit: {over / GiB:.2f} GiB over the device's {device.total_bytes / GiB:.2f} GiB")
    pool_tokens = pool.kv_tokens
    if blocks == 0:
        notes.append("no room for the KV cache: a smaller model, dtype or quantization, a shorter "
                     "max_model_len or fewer max_num_seqs would leave some")
    elif pool_tokens < max_len:
        notes.append(f"the pool holds {pool_tokens} tokens, less than max_model_len {max_len}: "
                     + ("the engine lowers max_model_len to it" if config.model.max_model_len is None
                        else "the engine refuses this config"))
    if context and context > min(max_len, pool_tokens):
        notes.append(f"a request of {context} tokens is longer than one request may be "
                     f"({min(max_len, pool_tokens)})")
    return Plan(model, device, items, pool, context or max_len, users, notes, draft_block)


def phase_capabilities(config: Config, registry: Registry) -> tuple[Capabilities, Capabilities]:
    """The prefill and decode backends' capabilities, as their classes say before a load (a
    backend that cannot start here: none, as the engine would fail on it)."""
    def caps(name: str) -> Capabilities:
        try:
            return registry.get(name)().capabilities()
        except Exception:
            return Capabilities()
    p, d = config.phases()
    return caps(p.name), caps(d.name)


def kv_groups(config: Config, arch: ModelArch, registry: Registry) -> KVGroups:
    """The pool's layout as the engine chooses it: in groups where the model mixes full and
    sliding layers, every phase's backend reads them and no K/V move between engines."""
    return pool_groups(arch, phase_capabilities(config, registry), not config.cluster.disaggregated)


def draft_model(config: Config, kind: str, registry: Registry) -> tuple[list[Item], int]:
    """``method = "draft"``: the draft's weights and the bytes of its pool per block of the
    target's (its pool holds as many blocks unless ``[speculative.draft] num_blocks`` is set)."""
    if config.speculative.method != "draft":
        return [], 0
    from twophase.builder.draft import draft_config

    cfg = draft_config(config)
    model = planned_model(cfg.model)
    context = model.arch.max_position_embeddings
    items = [dataclasses.replace(i, name=f"draft model: {i.name}", role="draft")
             for i in weight_items(cfg, model, kind, registry, min(cfg.model.max_model_len or context, context))]
    kv = KVHeads.of(model.arch)               # the draft's K/V (or latent) a token, every layer
    per_token = model.arch.num_layers * attention_spec(None, kv.num_kv_heads, kv.head_dim,
                                                       pool_settings(cfg, kind).format, kv.planes).bytes_per_token()
    if cfg.cache.num_blocks != "auto":
        per = per_token * cfg.cache.block_size
        items.append(Item("kv cache", "draft model's KV pool", int(cfg.cache.num_blocks) * per,
                          f"{cfg.cache.num_blocks} blocks", role="draft"))
        return items, 0
    return items, per_token * config.cache.block_size
