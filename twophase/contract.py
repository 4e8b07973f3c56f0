"""The contract between core and a backend: the whole surface a plugin author implements
(``twophase.backends.base`` re-exports it for plugins written against that name).

Core owns scheduling and the paged KV pool; a backend owns two operations over it:
``prefill`` (chunks of tokens after whatever is already cached, compute-bound) and ``decode``
(one token per sequence, memory-bound). Both write the new tokens' K/V into the pool at the
given slots and return logits; core samples.

KV pool layout (one tensor per engine):
    ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``
``2`` is K then V. A token's *slot* is ``block_id * block_size + offset``. Heads-major inside a
block, so exported graphs attend per block without a transpose. A model that mixes full and
sliding-window layers may get a pool in groups instead (``KVGroups``), for a backend that says it
reads one (``Capabilities.kv_groups``).

The contract has a version (``CONTRACT_VERSION``); a backend class says which one it was written
for (``Backend.contract_version``), and discovery refuses a version this twophase does not know:

- version 1 (the first release): ``ModelSpec.arch`` was a mapping of Llama config keys
  (``dict(model.arch)``, ``model.arch["num_layers"]``; the keys are ``V1_ARCH_KEYS``).
- version 2: ``ModelSpec.arch`` is the typed ``ModelArch`` (fields, one ``LayerSpec`` a layer);
  ``Capabilities.features`` and ``Backend.supports`` name the architecture features computed.

A version-1 backend still runs, with a ``FutureWarning`` at discovery: its ``load`` gets
``model.arch`` as ``ArchV1``, the typed ``ModelArch`` that also reads as the old mapping, with a
``DeprecationWarning`` (for the plugin's author) the first time it is read that way. One that declares
no version is taken as version 1. See docs/plugins.md, "Contract versions".
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from twophase.arch import ModelArch, describe, verb_for
from twophase.device import parse_device
from twophase.errors import BackendUnavailable, ConfigError
from twophase.kv_formats import kv_format_of

__all__ = [
    "CONTRACT_VERSION",
    "SUPPORTED_CONTRACT_VERSIONS",
    "ArchV1",
    "Backend",
    "BackendConfig",
    "BackendMemory",
    "BackendUnavailable",
    "Capabilities",
    "DecodeBatch",
    "EngineLimits",
    "KVCache",
    "KVCacheSpec",
    "KVGroups",
    "MemoryQuery",
    "ModelArch",
    "ModelSpec",
    "PrefillBatch",
    "WeightSource",
    "Workspace",
    "parse_device",
]

# the version of this contract; see the module's docstring for what each one changed
CONTRACT_VERSION = 2
# the versions a backend may declare: older ones run through a deprecated view (``ArchV1``)
SUPPORTED_CONTRACT_VERSIONS = (1, 2)
MIGRATION = "docs/plugins.md, section 'Contract versions'"

# version 1's architecture: the keys of the mapping ``ModelSpec.arch`` was
V1_ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_scaling", "bos_token_id",
                "eos_token_ids")


class ArchV1(ModelArch):
    """A ``ModelArch`` that also reads as version 1's mapping of config keys (``V1_ARCH_KEYS``):
    what a backend declaring ``contract_version = 1`` (or none) gets as ``model.arch``. Its typed
    fields are ``ModelArch``'s; each mapping access warns (``DeprecationWarning``)."""

    @classmethod
    def of(cls, arch: ModelArch) -> ArchV1:
        return cls(**{f.name: getattr(arch, f.name) for f in fields(arch)})

    def _v1(self, key: str) -> Any:
        if key == "attention_bias":
            return self.qkv_bias or self.o_bias
        if key in V1_ARCH_KEYS:
            return getattr(self, key)
        raise KeyError(key)

    def _warn(self) -> None:
        if self.__dict__.get("_warned"):        # once a view: dict(arch) reads every key
            return
        object.__setattr__(self, "_warned", True)
        warnings.warn("model.arch as a mapping of config keys is contract version 1 (deprecated): "
                      f"read ModelArch's fields (model.arch.hidden_size) and declare contract_version "
                      f"= {CONTRACT_VERSION} on the backend class; see {MIGRATION}",
                      DeprecationWarning, stacklevel=3)

    def keys(self) -> tuple[str, ...]:
        self._warn()
        return V1_ARCH_KEYS

    def __getitem__(self, key: str) -> Any:
        self._warn()
        return self._v1(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._warn()
        return self._v1(key) if key in V1_ARCH_KEYS else default

    def __iter__(self) -> Iterator[str]:
        self._warn()
        return iter(V1_ARCH_KEYS)

    def __len__(self) -> int:
        return len(V1_ARCH_KEYS)

    def __contains__(self, key: object) -> bool:
        self._warn()
        return key in V1_ARCH_KEYS

    def items(self) -> list[tuple[str, Any]]:
        self._warn()
        return [(k, self._v1(k)) for k in V1_ARCH_KEYS]

    def values(self) -> list[Any]:
        self._warn()
        return [self._v1(k) for k in V1_ARCH_KEYS]


@dataclass(frozen=True)
class WeightSource:
    """Where a model's weights are read from, each kind as what it is, so a loader reads the
    file it needs and never looks for one through another:

    - ``"gguf"``: ``path`` is the ``.gguf`` file, which the loaders that keep its blocks (q4,
      native) read as it is; ``float_cache`` is the HF folder its tensors were dequantised into
      once (keyed by the file), which the loaders that need floats read.
    - ``"folder"``: ``path`` is an HF folder (``config.json`` and ``*.safetensors``).
    - ``"random"``: numbers drawn from ``seed``.
    """

    kind: Literal["gguf", "folder", "random"]
    path: Path | None = None
    float_cache: Path | None = None
    seed: int = 0

    @classmethod
    def of(cls, weights: str, seed: int = 0) -> WeightSource:
        """The source that ``ModelSpec.weights`` names: random weights, else an HF folder."""
        return cls("random", seed=seed) if weights == "random" else cls("folder", Path(weights))

    @property
    def gguf(self) -> Path | None:
        """The GGUF file, for a model loaded from one."""
        return self.path if self.kind == "gguf" else None

    @property
    def floats(self) -> Path | None:
        """The HF folder that float weights are read from (None: random weights)."""
        return self.float_cache if self.kind == "gguf" else self.path

    @property
    def weights(self) -> str:
        """What ``ModelSpec.weights`` says of it: that folder, or "random"."""
        return "random" if self.floats is None else str(self.floats)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: the architecture, and where its weights come from."""

    arch: ModelArch               # the typed architecture, layer by layer (twophase.arch)
    # "random", or a folder with model.safetensors: the float weights (a GGUF's float cache)
    weights: str
    dtype: torch.dtype            # weights' and activations' dtype
    model_id: str                 # a name for reports and caches
    seed: int = 0                 # for random weights
    quantization: str = "none"    # "none", "q4" (4-bit blocks) or "gguf" (as the file stores them)
    accuracy_level: int = 4       # q4: ORT MatMulNBits' accuracy level (4: int8 activations)
    outlier_channels: int = 8     # q4: input channels per projection multiplied in float32
    # what ``state_dict()`` calls: set by core where the spec is made
    weight_loader: Callable[[], dict[str, torch.Tensor]] | None = field(
        default=None, compare=False, repr=False)
    # where the weights come from, as what they are; left out, what ``weights`` names
    source: WeightSource = None  # type: ignore[assignment]   # set in __post_init__

    def __post_init__(self) -> None:
        # ``weights`` and ``seed`` are what plugins read and older code sets (a spec replaced
        # field by field): a source that no longer agrees with them gives way to what they name
        s = self.source
        if s is None or s.weights != self.weights or (s.kind == "random" and s.seed != self.seed):
            object.__setattr__(self, "source", WeightSource.of(self.weights, self.seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights, float32 on the CPU, under the HF names of a Llama-style checkpoint
        (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
        ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm
        .weight``, ``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight``,
        ``lm_head.weight`` unless ``tie_word_embeddings``; ``.bias`` entries where the arch has
        biases). Random weights come out as the very numbers the torch reference draws from
        ``seed``, so a backend compares with it exactly, as the conformance kit does."""
        if self.weight_loader is None:
            raise BackendUnavailable("this ModelSpec carries no weights: make it with "
                                     "twophase.models.loader.model_spec (as the engine does)")
        return self.weight_loader()


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler's bounds on any one call, for backends that compile shapes ahead of time
    (TensorRT's optimisation profiles)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class BackendConfig:
    """One backend's TOML section: ``[backend]`` or ``[backend.prefill]`` / ``[backend.decode]``."""

    name: str = "torch"
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    limits: EngineLimits | None = None

    def check_options(self, allowed: set[str]) -> None:
        """Refuse an option this backend does not know, naming the key and the allowed ones."""
        unknown = sorted(set(self.options) - allowed)
        if unknown:
            raise ConfigError(f"backend.options.{unknown[0]}", f"unknown option for the {self.name} "
                              f"backend; allowed: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the scheduler and engine respect it."""

    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    max_num_seqs: int | None = None          # None: no limit of its own
    max_num_tokens: int | None = None        # tokens in one prefill call
    chunked_prefill: bool = True             # can it prefill a chunk after cached tokens?
    mixed_batches: bool = True               # can one prefill() carry decodes too?
    # does it read/write core's pool in place? (else it keeps its own: see bind_kv_cache)
    shares_kv_pool: bool = True
    # can it read a pool laid out in groups (``KVGroups``: a block table per group, layers
    # sharing slots)? Else a model mixing full and sliding layers keeps full K/V in every layer
    kv_groups: bool = False
    # does it compute on its own CPU threads (a runtime's pool, not torch's)? Then torch in
    # this process only does the step's glue, which the engine runs on one thread: an OpenMP
    # team woken for a 49k-logit argmax keeps spinning into the runtime's next call
    own_threads: bool = False
    # the most elements a pool it reads may have (a runtime indexing it with 32-bit offsets);
    # core sizes an automatic pool within it
    max_pool_elements: int | None = None
    # the architecture features it computes (keys of ``twophase.arch.FEATURES``); a model
    # using any other is refused by its name before load (see ``Backend.supports``)
    features: frozenset[str] = frozenset()
    # where it computes fewer features on some weight formats: quantization -> those it does
    # compute on them (see ``Backend.supports_weights``)
    features_on: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # where it computes fewer features in one phase: "prefill" (whose batches may carry decodes
    # too) or "decode" -> those it computes in that phase (see ``Backend.supports_phase``)
    features_in: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # how it computes a feature where that differs from the eager layers and costs otherwise
    # (feature -> a sentence; ``twophase backends`` prints them): experts traced in a static form
    computes: Mapping[str, str] = field(default_factory=dict)
    # the K/V formats (``twophase.kv_formats``) it reads and writes besides its model's dtype
    kv_formats: tuple[str, ...] = ()
    # does it apply LoRA adapters unmerged, each sequence its own (``PrefillBatch.lora_slots``)?
    # Then it implements ``place_adapter`` and keeps its torch module in ``model`` (adapters
    # are checked against its projections' shapes)
    adapters: bool = False
    # can its ``prefill`` return the final norm's hidden states instead of logits
    # (``PrefillBatch.output = "hidden"``)? Embeddings need it; the engine refuses a pooling
    # request, naming the backend, where its prefill backend does not say so
    hidden_states: bool = False


@dataclass(frozen=True)
class MemoryQuery:
    """What the memory planner (``twophase plan``) asks a backend about, before anything loads."""

    arch: ModelArch
    dtype: str                    # the model's: "float32", "bfloat16" or "float16"
    quantization: str             # ``model.quantization``: "none", "q4" or "gguf"
    device_kind: str              # "cpu" or "cuda": the device the plan is for
    options: dict[str, Any]       # the backend's TOML options
    limits: EngineLimits          # the scheduler's bounds on one call
    num_blocks: int               # the pool planned for: ``cache.num_blocks``, else max_num_seqs full contexts
    block_size: int


@dataclass(frozen=True)
class Workspace:
    """Device memory a backend sizes itself beside its weights (TensorRT's profiles)."""

    name: str                     # as the plan lists it
    bytes: int
    how: str                      # how it was counted, in a few words


@dataclass(frozen=True)
class BackendMemory:
    """What a backend holds beside core's KV pool, as the planner counts it (``Backend.memory``)."""

    # the weights as it holds them (``twophase.plan.weight_layouts``): "dense", every tensor in the
    # model's dtype; "blocks", the GGUF's q4 blocks as they are (native); "matmulnbits", ONNX
    # Runtime's MatMulNBits inputs for q4; "stored", every tensor as the GGUF stores it (gguf)
    layout: Literal["dense", "blocks", "matmulnbits", "stored"] = "dense"
    # graphs (sessions, engines) that each hold their own copy of the weights: ONNX Runtime's
    # decode and verify graphs beside its step graph
    weight_copies: int = 1
    # the embedding mapped from its file, its rows resident as tokens use them (native)
    mapped_embedding: bool = False
    # a tied head (``tie_word_embeddings``) packed as its own copy beside the embedding (ONNX
    # Runtime prepacks the head's MatMul apart from the embedding's Gather)
    tied_head_apart: bool = False
    # the generic peak of one step's activations applies; False where a workspace of its own
    # holds them (TensorRT's profiles)
    step_activations: bool = True
    # captures decode steps as CUDA graphs, whose private pool is counted (torch on CUDA)
    cuda_graphs: bool = False
    # device memory it sizes itself from ``MemoryQuery.limits`` and the pool (TensorRT's profiles)
    workspace: Workspace | None = None
    # the dtype it holds "dense" weights in where not the model's (torch's ``compute_dtype``)
    dtype: str | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block of the pool, from which core sizes the pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # extra blocks at the end of the pool that core never hands out: a backend that must write
    # somewhere for padding rows (CUDA graphs replay a fixed batch size) writes there
    scratch_blocks: int = 0
    # the pool's second axis: K and V (2), or one latent a token shared by every head (1: MLA,
    # with ``num_kv_heads`` 1 and ``head_dim`` the latent's width)
    planes: int = 2

    def bytes_per_block(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        row = kv_format_of(self.dtype).row(self.head_dim)
        return self.num_layers * self.planes * self.num_kv_heads * block_size * row * itemsize


@dataclass(frozen=True)
class KVGroups:
    """Which blocks each layer's K/V live in. Layers with the same window form groups of
    ``num_slots`` layers; each group has its own block table a sequence, all drawn from one
    pool of blocks, and layer ``i`` keeps its K/V at ``pool[slot[i]]`` in the blocks of group
    ``group[i]``'s table. So a sliding group gives back the blocks its window has passed while a
    full group keeps them, and a block is ``num_slots`` layers' worth of either.

    One group is the plain layout (slot ``i`` is layer ``i``); then the batches' ``slot_mapping``
    and ``block_tables`` are ``[T]`` and ``[B, nb]``. With more, they carry the group first:
    ``[G, T]`` and ``[G, B, nb]``, sent only to a backend whose ``Capabilities.kv_groups`` is set.
    A table entry before a sliding group's window is 0 (the blocks are gone), as padding is."""

    windows: tuple[int | None, ...]    # each group's sliding window in tokens (None: full)
    group: tuple[int, ...]             # each layer's group
    slot: tuple[int, ...]              # each layer's index in the pool's first dimension

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.slot) + 1

    @classmethod
    def plain(cls, num_layers: int, window: int | None = None) -> KVGroups:
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def of(cls, arch: ModelArch) -> KVGroups:
        """Groups for ``arch``'s attention layers (a state layer keeps no K/V; layer ``i`` here
        is the ``i``-th that attends): plain where every layer has the same window; else each window's
        layers cut, in order, into groups as large as the rarest window's count (vLLM's
        grouping: Gemma 3 27B's 10 full and 52 sliding layers make 1 + 6 groups of 10 slots,
        the last sliding group 2 layers short). Full-attention groups come first."""
        windows = [arch.layers[i].attention.window for i in arch.attention_layers]
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        if len(kinds) == 1:
            return cls.plain(len(windows), windows[0])
        size = min(windows.count(w) for w in kinds)
        group, slot = [0] * len(windows), [0] * len(windows)
        out: list[int | None] = []
        for w in kinds:
            layers = [i for i, x in enumerate(windows) if x == w]
            for j, i in enumerate(layers):
                if j % size == 0:
                    out.append(w)
                group[i], slot[i] = len(out) - 1, j % size
        return cls(tuple(out), tuple(group), tuple(slot))


@dataclass
class KVCache:
    """The pool core allocated: ``[slots, 2, num_blocks, kv_heads, block_size, head_dim]``,
    where slots are the layers (``groups`` plain) or ``groups.num_slots``."""

    pool: torch.Tensor
    block_size: int
    groups: KVGroups | None = None       # None: plain, one slot a layer
    # each state layer's tensors (``DeltaNetSpec.state_shapes``), a row a state slot:
    # ``[slots, *shape]``; a batch's ``state_slots`` say which row each sequence holds
    states: tuple[tuple[torch.Tensor, ...], ...] = ()

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy state rows, in order, in every state layer's tensors (a batch's ``state_copies``:
        every backend that holds states applies them before it computes)."""
        for src, dst in copies:
            for layer in self.states:
                for t in layer:
                    t[dst] = t[src]

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]


@dataclass
class PrefillBatch:
    """Chunks of several sequences, packed token after token (sequence ``i`` owns
    ``token_ids[query_start[i]:query_start[i+1]]``). A chunk may follow cached tokens
    (``start_positions[i] > 0``: an earlier chunk or a prefix-cache hit); a decode is a chunk of
    one token, so one batch may mix both phases. All tensors are int64 on the CPU."""

    token_ids: torch.Tensor        # [T] the chunks' tokens
    positions: torch.Tensor        # [T] each token's position in its sequence
    slot_mapping: torch.Tensor     # [T] pool slot where each token's K/V goes ([G, T]: KVGroups)
    block_tables: torch.Tensor     # [B, max_blocks] block ids, padding 0 ([G, B, nb]: KVGroups)
    context_lens: torch.Tensor     # [B] tokens in the cache after this call (start + chunk)
    query_lens: list[int]          # [B] chunk lengths
    start_positions: list[int]     # [B] tokens already cached before the chunk
    logits: Literal["last", "all"] = "last"   # one row per sequence, or one per token
    # what those rows hold: logits, or the hidden states the head would read (after the final
    # norm, before the head: ``[rows, hidden_size]``), for embeddings. "hidden" is sent only to
    # a backend whose ``Capabilities.hidden_states`` is set, in a batch of no other work
    output: Literal["logits", "hidden"] = "logits"
    # [B] each sequence's state slot (``KVCache.states``; a chunk at position 0 starts from
    # zeros); None for a model whose every layer attends
    state_slots: torch.Tensor | None = None
    # (from, to) state rows to copy, in order, before computing: a prefix hit's saved state
    # into its sequence's slot, or a slot's state saved for later hits
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # [B] each sequence's adapter slot (-1: the base model); None where none runs with one
    lora_slots: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def query_start(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out


@dataclass
class DecodeBatch:
    """One new token per sequence (the pure-decode fast path). All tensors int64 on the CPU."""

    token_ids: torch.Tensor        # [B]
    positions: torch.Tensor        # [B] == context_lens - 1
    slot_mapping: torch.Tensor     # [B] ([G, B]: KVGroups)
    block_tables: torch.Tensor     # [B, max_blocks] ([G, B, nb]: KVGroups)
    context_lens: torch.Tensor     # [B] tokens in the cache after this call
    state_slots: torch.Tensor | None = None   # [B] as ``PrefillBatch.state_slots``
    state_copies: list[tuple[int, int]] = field(default_factory=list)   # as ``PrefillBatch``'s
    lora_slots: list[int] | None = None        # as ``PrefillBatch``'s

    @property
    def num_seqs(self) -> int:
        return int(self.token_ids.shape[0])

    def as_prefill(self) -> PrefillBatch:
        """The same work as a batch of one-token chunks (for backends with one code path)."""
        lens = self.context_lens.tolist()
        return PrefillBatch(self.token_ids, self.positions, self.slot_mapping, self.block_tables,
                            self.context_lens, [1] * len(lens), [n - 1 for n in lens],
                            state_slots=self.state_slots, state_copies=self.state_copies,
                            lora_slots=self.lora_slots)


class Backend(ABC):
    """Implements ``prefill`` and ``decode`` for one model on one device.

    Lifecycle: ``__init__()`` (cheap, no arguments), ``load(model, cfg)`` (raise
    ``BackendUnavailable`` if it cannot run here), ``kv_cache_spec()``, ``bind_kv_cache(kv)``,
    then any number of ``prefill``/``decode`` calls.
    """

    name: ClassVar[str]
    # the contract version the class was written for (``CONTRACT_VERSION``); None: undeclared,
    # taken as 1. Discovery refuses one this twophase does not know, and a plugin's class does
    # not inherit a built-in's (twophase.backends.registry.declared_version)
    contract_version: ClassVar[int | None] = None
    # the weight formats it runs (``model.quantization``); core refuses the others before load
    quantizations: ClassVar[tuple[str, ...]] = ("none",)

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        """Raise ``BackendUnavailable`` with the reason if this backend cannot run on ``device``."""

    @classmethod
    def memory(cls, query: MemoryQuery) -> BackendMemory:
        """What it holds for ``query``'s model: the planner sizes the KV pool from it before
        anything loads. The default is a plain backend: one copy of the weights, in the model's
        dtype (q4 counted as MatMulNBits lays it out: 4-bit codes, and a scale, a zero point
        and a minimum's term each block of 32), and one step's activations."""
        return BackendMemory(layout="matmulnbits" if query.quantization == "q4" else "dense")

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    def supports(self, arch: ModelArch) -> str | None:
        """None if this backend computes ``arch``, else why not, naming what it lacks
        (``"native: QK-norm is not implemented"``). Called before ``load``; a backend with
        limits beyond ``Capabilities.features`` (shapes it cannot tile) adds them here."""
        missing = arch.features() - self.capabilities().features
        if not missing:
            return None
        return f"{self.name}: {describe(missing)} {verb_for(missing)} not implemented"

    def supports_weights(self, arch: ModelArch, quantization: str) -> str | None:
        """``supports``, and the features it computes only on some weight formats
        (``Capabilities.features_on``): what the engine and ``auto`` ask before load."""
        why = self.supports(arch)
        only = self.capabilities().features_on.get(quantization)
        missing = arch.features() - only if not why and only is not None else frozenset()
        if why or not missing:
            return why
        return f"{self.name}: {describe(missing)} on {quantization!r} weights {verb_for(missing)} not implemented"

    def supports_phase(self, arch: ModelArch, quantization: str, phase: str) -> str | None:
        """``supports_weights``, and the features it computes in the other phase only
        (``Capabilities.features_in``): what the engine asks of the backend of each phase
        (``"prefill"`` or ``"decode"``) before load."""
        why = self.supports_weights(arch, quantization)
        only = self.capabilities().features_in.get(phase)
        missing = arch.features() - only if not why and only is not None else frozenset()
        if why or not missing:
            return why
        return (f"{self.name}: {describe(missing)} in {phase} {verb_for(missing)} not implemented (give {phase} "
                f"another backend: [backend.{phase}] name = ...)")

    @abstractmethod
    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        """Build or load the model's weights on ``cfg.device``."""

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @abstractmethod
    def bind_kv_cache(self, kv: KVCache) -> None:
        """Use this pool for every later call (core allocated it on ``kv_cache_spec().device``).

        A backend that keeps its own pool (``shares_kv_pool = False``) allocates one of
        ``kv.pool``'s shape instead: zeroed when ``kv.pool`` is on the ``meta`` device (what the
        engine passes it, so memory is not spent twice), else a copy of its contents."""

    @abstractmethod
    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` (``logits="last"``) or ``[num_tokens, vocab]`` ("all"),
        float32 on any device. Afterwards the pool holds every chunk token's K/V at its slot.

        With ``batch.output == "hidden"`` (only where ``Capabilities.hidden_states``): the same
        rows of the final norm's output instead, ``[rows, hidden_size]`` in any float dtype,
        with no head, soft-capping or logit scaling applied."""

    @abstractmethod
    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]``. Afterwards the pool holds the new tokens' K/V."""

    def place_adapter(self, slot: int, adapter: Any) -> None:
        """Put a LoRA adapter's deltas (``twophase.lora.peft_adapter.LoraAdapter``) in ``slot``,
        or empty it (None); the sequences whose ``lora_slots`` name the slot then run with it.
        Only for a backend with ``Capabilities.adapters``."""
        raise NotImplementedError(f"the {self.name} backend does not apply LoRA adapters")

    @classmethod
    def engines_here(cls, device: str = "cpu") -> str | None:
        """What it computes with on this machine's ``device`` where that depends on the machine
        (an instruction set, a matrix engine), for ``twophase backends``; None: nothing to say.
        Read from the machine's description, nothing loaded or compiled."""
        return None

    def compute_dtype(self, phase: str) -> torch.dtype | None:
        """The arithmetic ``phase``'s ("prefill" or "decode") matmuls run in where it is not the
        model's dtype (int8 dots on 4-bit weights, bf16 tiles): the roofline takes that engine's
        ceiling (``twophase calibrate``). None: the model's dtype."""
        return None

    def read_kv_pool(self) -> torch.Tensor | None:
        """A copy of the pool a backend keeps itself (``shares_kv_pool = False``), for tests and
        the conformance kit; ``None`` for a backend that writes core's pool."""
        return None

    def close(self) -> None:
        """Release device resources (optional)."""
