"""IBM Granite 4 (``granitemoehybrid``): Mamba-2 layers (a recurrent state a sequence,
``layers/mamba2.py``) among attention layers, as ``layer_types`` lists them; experts beside an
ungated shared MLP (or that MLP alone, dense); Granite's multipliers on the embedding, each
residual branch, the attention scores and (dividing) the logits; RoPE or none."""

from __future__ import annotations

import math
from typing import Any

from twophase.arch import AttentionSpec, LayerSpec, Mamba2Spec, MLPSpec, ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, rope_theta

GRANITE_LAYER: LayerNames = {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")},
    "mixer.in_proj": (("mamba.in_proj",), ()),
    "mixer.conv": (("mamba.conv1d",), ()),
    "mixer.dt_bias": (("mamba.dt_bias",), ()),
    "mixer.A_log": (("mamba.A_log",), ()),
    "mixer.D": (("mamba.D",), ()),
    "mixer.norm": (("mamba.norm",), ()),
    "mixer.out_proj": (("mamba.out_proj",), ()),
    # experts stacked as stored ([E, 2f, h] gate then up, [E, h, f]); the shared MLP's gate and
    # up in one matrix too, as the dense MLP of a model without experts
    "mlp.router": (("block_sparse_moe.router.layer",), ()),
    "mlp.experts_gate_up": (("block_sparse_moe.input_linear",), ()),
    "mlp.experts_down": (("block_sparse_moe.output_linear",), ()),
    "mlp.shared.gate_up": (("shared_mlp.input_linear",), ()),
    "mlp.shared.down": (("shared_mlp.output_linear",), ()),
    "mlp.gate_up": (("shared_mlp.input_linear",), ()),
    "mlp.down": (("shared_mlp.output_linear",), ()),
}

MAMBA, ATTENTION = {"mamba", "linear_attention"}, {"attention", "full_attention"}


def _float(v: Any) -> float:
    """A number of config.json, transformers' ``{"__float__": "Infinity"}`` included."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def granite_from_hf(c: dict[str, Any]) -> ModelArch:
    n, hidden = c["num_hidden_layers"], c["hidden_size"]
    types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n
    unknown = sorted(set(types[:n]) - MAMBA - ATTENTION)
    if unknown:
        raise ValueError(f"layer_types {unknown} are neither mamba nor attention layers")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r}: Granite's layers are read with silu only")
    limit = c.get("time_step_limit")
    if limit is not None and (_float(limit[0]) != 0.0 or _float(limit[1]) != math.inf):
        raise ValueError(f"time_step_limit {limit}: only (0, inf), no clamp of dt, is computed")
    heads, expand = c.get("mamba_n_heads", 128), c.get("mamba_expand", 2)
    head_dim = c.get("mamba_d_head", "auto")
    head_dim = expand * hidden // heads if head_dim == "auto" else head_dim
    if heads * head_dim != expand * hidden:
        raise ValueError(f"mamba_n_heads {heads} x mamba_d_head {head_dim} is not mamba_expand x hidden_size "
                         f"{expand * hidden}")
    groups = c.get("mamba_n_groups", 1)
    if heads % groups:
        raise ValueError(f"mamba_n_heads {heads} is not a multiple of mamba_n_groups {groups}")
    mixer = Mamba2Spec(heads, head_dim, c.get("mamba_d_state", 256), groups, c.get("mamba_d_conv", 4),
                       c.get("mamba_chunk_size", 256), bool(c.get("mamba_conv_bias", True)),
                       bool(c.get("mamba_proj_bias", False)))
    E = c.get("num_local_experts", 8) or 0
    shared = c.get("shared_intermediate_size", 1024)
    mlp = (MLPSpec(c["intermediate_size"], E, c.get("num_experts_per_tok", 2), True, shared, shared_gated=False)
           if E else MLPSpec(shared))
    rope = c.get("position_embedding_type") == "rope"
    attention = AttentionSpec(None, rope_theta(c))
    layers = tuple(LayerSpec(attention, mlp, mixer if t in MAMBA else None) for t in types[:n])
    fields = common_fields(c)
    if not rope:
        fields["rope_scaling"] = None
    bias = bool(c.get("attention_bias", False))
    return ModelArch("granite", layers=layers, qkv_bias=bias, o_bias=bias, no_rope=not rope,
                     embed_scale=float(c.get("embedding_multiplier", 1.0)),
                     residual_scale=float(c.get("residual_multiplier", 1.0)),
                     query_scale=float(c.get("attention_multiplier", 1.0)),
                     logit_divisor=float(c.get("logits_scaling", 1.0)), **fields)


# no GGUF names: llama.cpp's ``granitehybrid`` files do not load yet
FAMILY = Family("granite", ("granitemoehybrid",), (), granite_from_hf, GRANITE_LAYER,
                hf_architecture="GraniteMoeHybridForCausalLM")
