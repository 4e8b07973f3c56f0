"""A model's architecture as typed values: what every backend computes from, layer by layer.

A backend reads the architecture from these fields only, never from a family's config, and
``ModelArch.features()`` names every departure from the plain Llama block. A backend declares the
features it computes (``Capabilities.features``); one that meets a feature it does not know
refuses the model by the feature's name rather than computing another model without a word.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

# feature key -> the name a refusal uses ("native: QK-norm is not implemented")
FEATURES: dict[str, str] = {
    "qkv_bias": "q/k/v biases",
    "o_bias": "an attention output bias",
    "mlp_bias": "MLP biases",
    "qk_norm": "QK-norm",
    "norm_offset": "(1 + w) RMSNorm",
    "post_norms": "post-attention and post-MLP norms",
    "gelu_tanh": "the tanh-GELU MLP",
    "embed_scale": "a scaled embedding",
    "attn_softcap": "attention logit soft-capping",
    "final_softcap": "final logit soft-capping",
    "query_scale": "a query scale other than 1/sqrt(head_dim)",
    "partial_rotary": "partial rotary embeddings",
    "rope_per_layer": "a RoPE base per layer type",
    "sliding_window": "sliding-window attention",
    "moe": "mixture-of-experts MLPs",
    "gated_deltanet": "Gated DeltaNet layers (a recurrent state a sequence)",
    "attn_output_gate": "a gated attention output",
    "short_conv": "gated short-convolution layers (a convolution state a sequence)",
    "mamba2": "Mamba-2 layers (a recurrent state a sequence)",
    "no_rope": "attention without RoPE",
    "residual_scale": "a scaled residual branch",
    "logit_divisor": "divided logits",
    "rope_yarn": "YaRN RoPE scaling",
    "attn_sinks": "attention sinks (a learned logit a head in every softmax's denominator)",
    "moe_bias": "router and expert biases",
    "clamped_swiglu": "the clamped SwiGLU (gpt-oss)",
    "mla": "multi-head latent attention (a latent a token shared by every head)",
    "moe_routing": "DeepSeek's expert routing (sigmoid scores, a choosing bias, groups, scaled weights)",
}


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention: over every earlier token, or over the last ``window`` of them."""

    window: int | None = None        # sliding window in tokens (the query's own included)
    rope_theta: float = 10000.0

    @property
    def kind(self) -> Literal["full", "sliding"]:
        return "sliding" if self.window else "full"


@dataclass(frozen=True)
class MLPSpec:
    """One layer's MLP: a gated dense MLP, or ``num_experts`` of them with a router."""

    intermediate_size: int           # the dense MLP's width, or each expert's
    num_experts: int = 0             # 0: dense
    top_k: int = 0                   # experts each token is routed to
    norm_topk_prob: bool = True      # renormalise the top-k router weights to sum to 1
    shared_intermediate_size: int = 0   # an always-on shared expert's width (0: none)
    shared_gated: bool = True        # the shared expert's output times sigmoid(a gate); Granite's is not
    # DeepSeek's routing: scores by softmax or sigmoid; a bias added to choose (not to weigh);
    # experts in ``groups``, only the ``topk_groups`` best groups (by their best score, or the
    # sum of their best two) chosen from; the chosen weights times ``routed_scale``
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    score_bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2"] = "max"
    routed_scale: float = 1.0

    @property
    def routing_is_plain(self) -> bool:
        """Softmax over every expert, the top k, no groups, bias or scale."""
        return (self.scoring == "softmax" and not self.score_bias and self.groups == 1
                and self.routed_scale == 1.0)

    @property
    def kind(self) -> Literal["dense", "moe"]:
        return "moe" if self.num_experts else "dense"


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): a token's keys and values for every head
    come from one latent of ``kv_lora_rank`` values (RMS-normed) through ``kv_b``, beside one
    rotary key of ``qk_rope_head_dim`` that every head shares. The cache holds those two, a
    token a layer, no heads. A head's query is ``qk_nope_head_dim`` plain values and
    ``qk_rope_head_dim`` rotated ones (from ``q_lora_rank`` through a norm, or straight from the
    hidden state where it is None); its value has ``v_head_dim``."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleaved: bool = True     # rotary dimensions in pairs (x0, x1), (x2, x3), ...

    @property
    def latent_dim(self) -> int:
        """Values the cache holds a token a layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class StateLayerSpec:
    """A layer that keeps a fixed-size state a sequence in place of K/V (its token mixer). Each
    kind is a subclass here, named by ``kind`` (its key in ``FEATURES``), with a module of that
    kind in ``models/layers/`` (``models/layers/state.py: STATE_LAYERS``)."""

    kind: ClassVar[str]

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state tensors in one layer."""
        raise NotImplementedError

    def step_flops(self) -> float:
        """FLOPs one token's state update and read take (the roofline's count)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DeltaNetSpec(StateLayerSpec):
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5): a causal depthwise convolution over q, k
    and v, L2-normalised q and k, and a gated delta rule that keeps one ``[k_head_dim,
    v_head_dim]`` matrix a value head in place of K/V. Its cache is a state a sequence: the
    last ``conv_kernel - 1`` inputs of the convolution and the matrices."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    # Qwen3-Next's fused projection groups q, k, v and z by key head; Qwen3.5's keeps them apart
    interleaved: bool = False

    kind: ClassVar[str] = "gated_deltanet"

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state tensors: the convolution's tail, the delta rule's matrices."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def step_flops(self) -> float:
        """Decay, ``S^T k``, the rank-one update and ``S^T q``: about 7 operations an element of
        each value head's matrix (the convolution's few are left out)."""
        return 7.0 * self.num_v_heads * self.k_head_dim * self.v_head_dim


@dataclass(frozen=True)
class ShortConvSpec(StateLayerSpec):
    """A gated short convolution (LFM2): ``in_proj`` gives B, C and x, a causal depthwise
    convolution of ``conv_kernel`` taps runs over ``B * x``, C gates its output, ``out_proj``.
    Its cache is a state a sequence: the convolution's last ``conv_kernel - 1`` inputs."""

    channels: int
    conv_kernel: int = 3
    bias: bool = False               # on in_proj, the convolution and out_proj alike

    kind: ClassVar[str] = "short_conv"

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.channels, self.conv_kernel - 1),)

    def step_flops(self) -> float:
        """The convolution's taps and the two gates (the projections are the layer's weights)."""
        return 2.0 * self.channels * (self.conv_kernel + 1)



@dataclass(frozen=True)
class Mamba2Spec(StateLayerSpec):
    """A Mamba-2 (SSD) layer (Granite 4): a causal depthwise convolution over x, B and C, then a
    selective scan whose ``num_heads`` heads each keep a ``[head_dim, state_size]`` matrix,
    decayed by ``exp(dt A)`` a token; B and C come in ``n_groups`` groups shared by the heads,
    the output is gated by ``silu(z)`` and RMS-normed in ``n_groups`` groups. Its cache is a state
    a sequence: the last ``conv_kernel - 1`` inputs of the convolution and the matrices."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256            # tokens the chunked scan takes at once
    conv_bias: bool = True
    proj_bias: bool = False          # in_proj and out_proj

    kind: ClassVar[str] = "mamba2"

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.n_groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state tensors: the convolution's tail, each head's matrix."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    def step_flops(self) -> float:
        """Decay, the ``dt x B^T`` update and ``S C``: about 5 operations an element of each
        head's matrix (the convolution's few are left out)."""
        return 5.0 * self.num_heads * self.head_dim * self.state_size


STATE_LAYER_SPECS: tuple[type[StateLayerSpec], ...] = (DeltaNetSpec, ShortConvSpec, Mamba2Spec)


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    mlp: MLPSpec
    mixer: StateLayerSpec | None = None    # None: the layer attends; else its state layer

    @property
    def attends(self) -> bool:
        return self.mixer is None


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer: embedding, ``layers`` blocks (pre-norm attention and MLP,
    residual), final norm, head. Defaults are Llama's; every other value is a named feature."""

    family: str                      # the family file that made it ("llama", "qwen3", ...)
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False            # RMSNorm over each head of q and k, before RoPE
    norm_offset: float = 0.0         # RMSNorm scales by (offset + w): Gemma's 1
    post_norms: bool = False         # Gemma: a norm on the attention's and the MLP's output too
    # the MLP's gate: SwiGLU, Gemma's tanh-GELU, or gpt-oss's clamped SwiGLU
    # (min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1))
    activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
    swiglu_alpha: float = 1.702           # clamped_swiglu's
    swiglu_limit: float = 7.0
    embed_scale: float = 1.0         # Gemma: sqrt(hidden_size)
    attn_softcap: float | None = None     # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None    # logits -> cap * tanh(logits / cap)
    query_scale: float | None = None      # None: head_dim ** -0.5
    rotary_dim: int | None = None         # None: all of head_dim rotates
    attn_output_gate: bool = False        # Qwen3-Next: q_proj also gives a gate, out * sigmoid(gate)
    no_rope: bool = False                 # Granite 4 (hybrid): attention without rotary embeddings
    residual_scale: float = 1.0           # Granite: x + scale * block(x), attention's and MLP's
    logit_divisor: float = 1.0            # Granite: logits / divisor
    attn_sinks: bool = False              # gpt-oss: a learned logit a head joins each softmax's sum
    mla: MLASpec | None = None            # DeepSeek: latent attention (head_dim is q.k's: nope + rope)
    # Llama-3 RoPE scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V (the others keep a state)."""
        return tuple(i for i, s in enumerate(self.layers) if s.attends)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if not s.attends)

    @property
    def intermediate_size(self) -> int:
        """The first layer's MLP width (each expert's, for a MoE)."""
        return self.layers[0].mlp.intermediate_size

    @property
    def rope_theta(self) -> float:
        return self.layers[0].attention.rope_theta

    @property
    def scale(self) -> float:
        """q.k's scale: the family's (1/sqrt(head_dim) by default) times YaRN's attention
        factor squared, which cos and sin carry to both q and k where every dimension turns."""
        base = self.query_scale if self.query_scale is not None else self.head_dim ** -0.5
        return base * (self.rope_scaling or {}).get("attention_factor", 1.0) ** 2

    def features(self) -> frozenset[str]:
        """The keys of ``FEATURES`` this architecture uses."""
        on = {k for k in ("qkv_bias", "o_bias", "qk_norm", "post_norms", "attn_sinks") if getattr(self, k)}
        moe = [bool(s.mlp.num_experts) for s in self.layers]
        checks = {
            "norm_offset": self.norm_offset != 0.0,
            "gelu_tanh": self.activation == "gelu_tanh",
            "clamped_swiglu": self.activation == "clamped_swiglu",
            # one flag, named by where it applies: dense MLPs' biases, or the router's and experts'
            "mlp_bias": self.mlp_bias and not all(moe),
            "moe_bias": self.mlp_bias and any(moe),
            "embed_scale": self.embed_scale != 1.0,
            "attn_softcap": self.attn_softcap is not None,
            "final_softcap": self.final_softcap is not None,
            "query_scale": self.query_scale is not None and abs(self.scale - self.head_dim ** -0.5) > 1e-12,
            "partial_rotary": self.rotary_dim is not None and self.rotary_dim != self.head_dim,
            "rope_per_layer": len({s.attention.rope_theta for s in self.layers}) > 1,
            "sliding_window": any(s.attention.window for s in self.layers),
            "moe": any(moe),
            "mla": self.mla is not None,
            "moe_routing": any(not s.mlp.routing_is_plain for s in self.layers if s.mlp.num_experts),
            "attn_output_gate": self.attn_output_gate,
            "no_rope": self.no_rope,
            "residual_scale": self.residual_scale != 1.0,
            "rope_yarn": (self.rope_scaling or {}).get("rope_type") == "yarn",
            "logit_divisor": self.logit_divisor != 1.0,
        }
        kinds = {s.mixer.kind for s in self.layers if s.mixer is not None}
        return frozenset(on | kinds | {k for k, v in checks.items() if v})

    def with_layers(self, num_layers: int) -> ModelArch:
        """The same model cut (or repeated, by its layer pattern) to ``num_layers`` layers."""
        pattern = self.layers
        return replace(self, layers=tuple(pattern[i % len(pattern)] for i in range(num_layers)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArch:
        d = dict(d)
        d["layers"] = tuple(LayerSpec(AttentionSpec(**s["attention"]), MLPSpec(**s["mlp"]),
                                      state_layer_spec(s["mixer"]) if s.get("mixer") else None)
                            for s in d["layers"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("mla"):
            d["mla"] = MLASpec(**d["mla"])
        return cls(**d)


def state_layer_spec(d: dict[str, Any]) -> StateLayerSpec:
    """A state layer's spec from ``to_dict``'s fields (each kind has its own)."""
    for cls in STATE_LAYER_SPECS:
        if {f.name for f in fields(cls)} == set(d):
            return cls(**d)
    raise ValueError(f"no kind of state layer has the fields {sorted(d)}")


def describe(features: frozenset[str] | set[str]) -> str:
    """``"QK-norm and q/k/v biases"``: the refusal's wording for missing features."""
    names = [FEATURES.get(f, f) for f in sorted(features)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def verb_for(features: frozenset[str] | set[str]) -> str:
    """"are" for several features or one named in the plural ("MLP biases", "attention sinks
    (...)"), else "is": the verb after ``describe``."""
    one = FEATURES.get(next(iter(features)), "") if len(features) == 1 else ""
    return "is" if len(features) == 1 and not one.split(" (")[0].endswith("s") else "are"


def uniform_layers(num_layers: int, intermediate_size: int, rope_theta: float = 10000.0,
                   window: int | None = None) -> tuple[LayerSpec, ...]:
    """``num_layers`` identical layers: the dense, full-attention case of most families."""
    spec = LayerSpec(AttentionSpec(window, rope_theta), MLPSpec(intermediate_size))
    return (spec,) * num_layers


def with_feature(arch: ModelArch, key: str) -> ModelArch:
    """``arch`` changed to use one feature of ``FEATURES``: how tests and the conformance kit
    ask a backend about each feature it does not claim."""
    hd, f = arch.head_dim, arch.intermediate_size
    simple: dict[str, dict[str, Any]] = {
        "qkv_bias": {"qkv_bias": True}, "o_bias": {"o_bias": True}, "mlp_bias": {"mlp_bias": True},
        "qk_norm": {"qk_norm": True}, "norm_offset": {"norm_offset": 1.0}, "post_norms": {"post_norms": True},
        "gelu_tanh": {"activation": "gelu_tanh"}, "embed_scale": {"embed_scale": 2.0},
        "attn_softcap": {"attn_softcap": 50.0}, "final_softcap": {"final_softcap": 30.0},
        "query_scale": {"query_scale": 0.5 * hd ** -0.5}, "partial_rotary": {"rotary_dim": hd // 2},
        "attn_output_gate": {"attn_output_gate": True}, "no_rope": {"no_rope": True},
        "residual_scale": {"residual_scale": 0.5}, "logit_divisor": {"logit_divisor": 4.0},
        "attn_sinks": {"attn_sinks": True}, "clamped_swiglu": {"activation": "clamped_swiglu"},
        "rope_yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                       "attention_factor": 0.1 * math.log(4.0) + 1.0}},
    }
    if key in simple:
        return replace(arch, **simple[key])
    if key == "mla":             # every head its own query, keys and values from one latent
        return replace(arch, num_kv_heads=arch.num_heads, rotary_dim=hd // 2,
                       mla=MLASpec(2 * hd, hd // 2, hd // 2, hd))
    layers = list(arch.layers)
    for i, s in enumerate(layers):
        if key == "rope_per_layer" and i % 2:
            layers[i] = replace(s, attention=replace(s.attention, rope_theta=s.attention.rope_theta * 10))
        elif key == "sliding_window":
            layers[i] = replace(s, attention=replace(s.attention, window=16))
        elif key in ("moe", "moe_bias"):
            layers[i] = replace(s, mlp=MLPSpec(f, num_experts=4, top_k=2))
        elif key == "moe_routing":
            layers[i] = replace(s, mlp=MLPSpec(f, num_experts=4, top_k=2, scoring="sigmoid", score_bias=True,
                                               groups=2, group_score="top2", routed_scale=2.5))
        elif key == "gated_deltanet" and i % 4 != 3:        # Qwen3-Next's three in four
            layers[i] = replace(s, mixer=DeltaNetSpec(2, 4, hd, hd))
        elif key == "short_conv" and i % 2 == 0:            # LFM2 mixes them with attention
            layers[i] = replace(s, mixer=ShortConvSpec(arch.hidden_size))
        elif key == "mamba2" and i % 4 != 3:
            layers[i] = replace(s, mixer=Mamba2Spec(4, hd, 16))
    if key not in FEATURES:
        raise KeyError(key)
    return replace(arch, layers=tuple(layers), mlp_bias=arch.mlp_bias or key == "moe_bias")
