"""The pool layout: from the architecture, the cache settings, the backends' capabilities and the
bytes free, each layer group's cache spec, the block count, the longest request and a step's
token budget.

One pure function (``lay_out_pool``) that the engine's loader, the memory planner, the simulator
and ``twophase plan`` all call, so the pool a plan shows is the pool an engine allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from twophase.arch import ModelArch
from twophase.cache.spec import (
    CacheSpec,
    StateSpec,
    attention_spec,
    concurrency,
    context_tokens,
    sequence_blocks,
    step_blocks,
)
from twophase.contract import Capabilities, KVCacheSpec, KVGroups

GiB = 1 << 30
CPU_POOL_CAP = 2 * GiB              # the CPU pool's default: min(2 GiB, a quarter of free)
CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET = 512, 4096     # a step's tokens with chunked prefill


@dataclass(frozen=True)
class PoolSettings:
    """What the config asks of the pool and of a step (``[cache]``, ``[scheduler]``, ``[model]``)."""

    block_size: int
    num_blocks: int | None            # None: as many as the memory allows ("auto")
    memory_bytes: int | None          # ``cache.memory_gb``; None: a share of what is free
    format: str                       # the K/V format's name, the model's dtype resolved
    max_num_seqs: int
    max_num_batched_tokens: int | None
    chunked_prefill: bool
    max_model_len: int | None         # ``model.max_model_len``; None: the model's context
    device_kind: str                  # "cpu" or "cuda"
    state_snapshots: int = 0          # state rows kept for prefix hits (state layers, prefix caching)
    speculative: bool = False         # drafts are verified: a state row a sequence kept before each verify


@dataclass(frozen=True)
class KVHeads:
    """The K/V an attention layer keeps a token, as the backends hold it: ``planes`` (K and V,
    or one latent) of ``num_kv_heads`` rows of ``head_dim``."""

    num_kv_heads: int
    head_dim: int
    planes: int = 2

    @classmethod
    def of(cls, arch: ModelArch) -> KVHeads:
        if arch.mla is not None:          # one latent a token, shared by every head
            return cls(1, arch.mla.latent_dim, 1)
        return cls(arch.num_kv_heads, arch.head_dim)

    def spec(self, num_layers: int, dtype: torch.dtype, device: torch.device, scratch_blocks: int = 0) -> KVCacheSpec:
        """A backend's ``kv_cache_spec`` for layers of these heads (or this latent)."""
        return KVCacheSpec(num_layers, self.num_kv_heads, self.head_dim, dtype, device, scratch_blocks, self.planes)


@dataclass(frozen=True)
class PoolLayout:
    groups: KVGroups                  # which slot and group each layer's cache is in
    specs: tuple[CacheSpec, ...]      # one a group
    block_size: int
    num_blocks: int                   # blocks core hands out
    scratch_blocks: int               # blocks after them that only padding rows write
    model_len: int                    # the longest request the model and config allow
    chunk: int                        # a step's tokens, as the pool was sized for them
    token_budget: int                 # tokens one step may compute
    max_num_seqs: int                 # sequences one step may carry
    chunked_prefill: bool             # may a prompt be computed in chunks?
    at_backend_limit: bool = False    # did an index limit of a backend cap the pool?
    state: StateSpec | None = None    # the state layers' cache (None: every layer attends)
    state_slots: int = 0              # state rows: one a running sequence, then the snapshots
    state_snapshots: int = 0          # of them, rows that keep a prefix's state for later hits
    state_verify_rows: bool = False   # and as many rows as slots, for the state before a verify

    @property
    def state_bytes(self) -> int:
        """Bytes of every state slot, beside the blocks."""
        return self.state_slots * self.state.bytes_per_sequence() if self.state else 0

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(s.window for s in self.specs)

    @property
    def slot_bytes_per_token(self) -> int:
        """Bytes a token takes in one slot of the pool (one layer's K/V)."""
        return self.specs[0].bytes_per_token()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block: its tokens in every slot."""
        return self.groups.num_slots * self.specs[0].page_bytes(self.block_size)

    @property
    def pool_bytes(self) -> int:
        return (self.num_blocks + self.scratch_blocks) * self.page_bytes

    @property
    def pool_tokens(self) -> int:
        """The longest sequence the blocks hold (without bound where every group slides)."""
        return context_tokens(self.specs, self.num_blocks, self.chunk, self.block_size)

    @property
    def kv_tokens(self) -> int:
        """The longest context one sequence may have in the pool, at most every block's tokens."""
        return min(self.num_blocks * self.block_size, self.pool_tokens)

    @property
    def max_model_len(self) -> int:
        """The longest request: the model's and config's, or less where the pool holds less."""
        return min(self.model_len, self.pool_tokens)

    def concurrency(self, context: int) -> int:
        """Sequences of ``context`` tokens the pool holds at once (at most a state slot each)."""
        n = concurrency(self.specs, self.num_blocks, context, self.chunk, self.block_size)
        return min(n, self.running_slots) if self.state else n

    @property
    def running_slots(self) -> int:
        """State rows that running sequences hold (one each)."""
        return (self.state_slots - self.state_snapshots) // (2 if self.state_verify_rows else 1)

    def sequence_bytes(self, context: int) -> int:
        """The cache one sequence of ``context`` tokens holds once it is in (a sliding layer's
        window's, a full layer's every token, a state layer's state)."""
        return (sequence_blocks(self.specs, context, 1, self.block_size) * self.block_size
                * self.groups.num_slots * self.slot_bytes_per_token
                + (self.state.bytes_per_sequence() if self.state else 0))


def model_len(arch: ModelArch, settings: PoolSettings) -> int:
    """The longest request the model and config allow, before a pool is laid out: the model's
    context, the config's ``max_model_len`` below it, and where the pool's size is fixed and
    the config names no length, what those blocks hold (the layers in groups)."""
    limit = arch.max_position_embeddings
    n = min(settings.max_model_len or limit, limit)
    if settings.num_blocks is not None and settings.max_model_len is None:
        n = min(n, fixed_pool_tokens(arch, settings, n))
    return n


def fixed_pool_tokens(arch: ModelArch, settings: PoolSettings, length: int) -> int:
    """The longest sequence a fixed ``cache.num_blocks`` hold, the layers in groups."""
    assert settings.num_blocks is not None
    specs = group_specs(KVGroups.of(arch), KVHeads.of(arch), settings.format)
    return context_tokens(specs, settings.num_blocks, token_budget(settings, length, settings.chunked_prefill),
                          settings.block_size)


def state_spec(arch: ModelArch) -> StateSpec | None:
    """The state layers' cache, in float32 (the recurrence accumulates in it); None without any."""
    mixers = [arch.layers[i].mixer for i in arch.state_layers]
    if not mixers:
        return None
    shapes = {m.state_shapes() for m in mixers if m is not None}
    if len(shapes) > 1:
        raise ValueError("state layers of different shapes in one model")
    return StateSpec(len(mixers), shapes.pop())


def token_budget(settings: PoolSettings, length: int, chunked: bool) -> int:
    """Tokens one step may compute: the config's, else a default for the device with chunked
    prefill, else a whole request of ``length``."""
    default = CUDA_TOKEN_BUDGET if settings.device_kind == "cuda" else CPU_TOKEN_BUDGET
    return settings.max_num_batched_tokens or (default if chunked else length)


def group_specs(groups: KVGroups, kv: KVHeads, format: str) -> tuple[CacheSpec, ...]:
    return tuple(attention_spec(w, kv.num_kv_heads, kv.head_dim, format, kv.planes) for w in groups.windows)


def pool_groups(arch: ModelArch, backends: Sequence[Capabilities], may_group: bool) -> KVGroups:
    """In groups where the model mixes full and sliding layers, every backend reads groups and
    ``may_group`` (no K/V move between engines in one block table); else a slot a layer."""
    groups = KVGroups.of(arch)
    if groups.num_groups > 1 and may_group and all(c.kv_groups for c in backends):
        return groups
    return KVGroups.plain(len(arch.attention_layers)) if groups.num_groups > 1 else groups


def index_limit(backends: Sequence[Capabilities], groups: KVGroups, kv: KVHeads, block_size: int,
                scratch_blocks: int) -> int | None:
    """The most blocks every backend can index (``Capabilities.max_pool_elements``)."""
    per_block = groups.num_slots * kv.planes * kv.num_kv_heads * block_size * kv.head_dim
    known = [c.max_pool_elements // per_block - scratch_blocks for c in backends if c.max_pool_elements]
    return min(known) if known else None


def lay_out_pool(arch: ModelArch, settings: PoolSettings, prefill: Capabilities, others: Sequence[Capabilities],
                 bytes_free: int, *, kv: KVHeads | None = None, may_group: bool = True, scratch_blocks: int = 0,
                 extra_bytes_per_block: int = 0, minimum_blocks: int = 0) -> PoolLayout:
    """The pool for ``arch`` under ``settings`` on backends of these capabilities (``prefill``'s,
    then the decode backend's and those ``auto`` routes small decode batches to, ``others``).

    ``bytes_free``: what the pool may take from (``cache.memory_gb`` overrides it; on the CPU a
    quarter of it, at most 2 GiB). ``kv``: the K/V a layer keeps a token as the backends hold
    it (the architecture's by default). ``extra_bytes_per_block``: memory that grows block for
    block beside the pool (a draft model's own pool). ``scratch_blocks``: blocks past the pool
    that the backends' index limit must also cover."""
    kv = kv or KVHeads.of(arch)
    backends = [prefill, *others]
    groups = pool_groups(arch, backends, may_group)
    specs = group_specs(groups, kv, settings.format)
    length = model_len(arch, settings)
    chunk = token_budget(settings, length, settings.chunked_prefill)
    bs = settings.block_size
    page = groups.num_slots * specs[0].page_bytes(bs)
    limit = index_limit(backends, groups, kv, bs, scratch_blocks)
    capped = False
    state = state_spec(arch)
    rows = settings.max_num_seqs * (2 if settings.speculative else 1) + settings.state_snapshots if state else 0
    state_bytes = rows * state.bytes_per_sequence() if state else 0
    if settings.num_blocks is not None:
        num_blocks = settings.num_blocks
    else:
        if settings.memory_bytes is not None:
            budget = settings.memory_bytes
        elif settings.device_kind == "cuda":
            budget = bytes_free
        else:
            budget = min(CPU_POOL_CAP, bytes_free // 4)
        wanted = settings.max_num_seqs * sequence_blocks(specs, length, 1, bs) + step_blocks(specs, chunk, bs)
        num_blocks = min(max(0, (budget - state_bytes) // (page + extra_bytes_per_block)), wanted)
        if limit is not None and num_blocks >= limit:
            num_blocks, capped = limit, True
        num_blocks = max(minimum_blocks, num_blocks)
    layout = PoolLayout(groups, specs, bs, num_blocks, scratch_blocks, length, chunk, chunk, settings.max_num_seqs,
                        settings.chunked_prefill, capped, state, rows, settings.state_snapshots if state else 0,
                        settings.speculative and state is not None)
    return with_step_limits(layout, settings, prefill, others[:1])


def with_step_limits(layout: PoolLayout, settings: PoolSettings, prefill: Capabilities,
                     decode: Sequence[Capabilities]) -> PoolLayout:
    """``layout`` with a step's limits for ``settings``' scheduler on these backends: chunked
    prefill where the prefill backend can, a token budget within its largest call, the fewest
    sequences either phase's backend takes. (A new scheduler over the same pool takes these.)"""
    chunked = settings.chunked_prefill and prefill.chunked_prefill
    budget = token_budget(settings, layout.max_model_len, chunked)
    if prefill.max_num_tokens:
        budget = min(budget, prefill.max_num_tokens)
    max_seqs = min(x for x in (settings.max_num_seqs, prefill.max_num_seqs, *(c.max_num_seqs for c in decode)) if x)
    return replace(layout, token_budget=budget, max_num_seqs=max_seqs, chunked_prefill=chunked)
