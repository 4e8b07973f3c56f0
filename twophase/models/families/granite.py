"""IBM Granite 4 (``granitemoehybrid``): Mamba-2 layers (a recurrent state a sequence,
``layers/mamba2.py``) among attention layers, as ``layer_types`` lists them; experts beside an
ungated shared MLP (or that MLP alone, dense); Granite's multipliers on the embedding, each
residual branch, the attention scores and (dividing) the logits; RoPE or none."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from twophase.arch import AttentionSpec, LayerSpec, Mamba2Spec, MLPSpec, ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, rope_theta, stated

GRANITE_LAYER: LayerNames = {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")},
    "mixer.in_proj": (("mamba.in_proj",), ("ssm_in",)),
    "mixer.conv": (("mamba.conv1d",), ("ssm_conv1d",)),
    "mixer.dt_bias": (("mamba.dt_bias",), ("ssm_dt",)),
    "mixer.A_log": (("mamba.A_log",), ("ssm_a",)),
    "mixer.D": (("mamba.D",), ("ssm_d",)),
    "mixer.norm": (("mamba.norm",), ("ssm_norm",)),
    "mixer.out_proj": (("mamba.out_proj",), ("ssm_out",)),
    # experts stacked as stored ([E, 2f, h] gate then up, [E, h, f]); the shared MLP's gate and
    # up in one matrix too, as the dense MLP of a model without experts. llama.cpp stores each
    # of those gate-then-up matrices as its gate and its up halves
    "mlp.router": (("block_sparse_moe.router.layer",), ("ffn_gate_inp",)),
    "mlp.experts_gate_up": (("block_sparse_moe.input_linear",), ("ffn_gate_exps+ffn_up_exps",)),
    "mlp.experts_down": (("block_sparse_moe.output_linear",), ("ffn_down_exps",)),
    "mlp.shared.gate_up": (("shared_mlp.input_linear",), ("ffn_gate_shexp+ffn_up_shexp",)),
    "mlp.shared.down": (("shared_mlp.output_linear",), ("ffn_down_shexp",)),
    "mlp.gate_up": (("shared_mlp.input_linear",), ("ffn_gate+ffn_up",)),
    "mlp.down": (("shared_mlp.output_linear",), ("ffn_down",)),
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


def granite_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """llama.cpp's ``granitehybrid`` keys: the key-value heads a layer (0 for a Mamba-2 layer),
    the Mamba-2 shapes as its ``ssm`` keys (heads as ``time_step_rank``, their width as
    ``inner_size``), the biases by their tensors, the experts, RoPE as
    ``rope.scaling.finetuned`` (on where unstated), and the multipliers as its ``scale`` keys;
    a file without ``attention.scale`` scales the scores by 1/sqrt(head_dim), as llama.cpp does."""
    n, hidden = int(stated(get, p + "block_count")), int(stated(get, p + "embedding_length"))
    kv = stated(get, p + "attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n
    heads, inner = int(stated(get, p + "ssm.time_step_rank")), int(stated(get, p + "ssm.inner_size"))
    head_dim = get(p + "attention.key_length") or hidden // int(stated(get, p + "attention.head_count"))
    attention = get(p + "attention.scale")
    return {"layer_types": ["mamba" if k == 0 else "attention" for k in kv],
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // hidden,
            "mamba_d_state": int(stated(get, p + "ssm.state_size")),
            "mamba_n_groups": int(stated(get, p + "ssm.group_count")),
            "mamba_d_conv": int(stated(get, p + "ssm.conv_kernel")),
            "mamba_conv_bias": any(t.endswith(".ssm_conv1d.bias") for t in tensors),
            "mamba_proj_bias": any(t.endswith(".ssm_in.bias") for t in tensors),
            "num_local_experts": int(get(p + "expert_count", 0)),
            "num_experts_per_tok": int(get(p + "expert_used_count", 0)),
            "shared_intermediate_size": int(stated(get, p + "expert_shared_feed_forward_length")),
            "position_embedding_type": "rope" if get(p + "rope.scaling.finetuned", True) else "nope",
            "embedding_multiplier": float(get(p + "embedding_scale", 1.0)),
            "residual_multiplier": float(get(p + "residual_scale", 1.0)),
            "attention_multiplier": float(attention) if attention else head_dim ** -0.5,
            "logits_scaling": float(get(p + "logit_scale", 1.0))}


def granite_tensors(name: str, hf: str, w: np.ndarray, read: Callable[[str], np.ndarray],
                    get: Callable[..., Any]) -> dict[str, np.ndarray]:
    """llama.cpp stores each gate-then-up matrix as its two halves (read back at the gate's),
    ``A_log`` as ``A = -exp(A_log)`` and ``D`` as columns ``[heads, 1]``, the convolution
    ``[channels, 1, taps]`` squeezed and the gated norm ``[groups, channels / groups]``."""
    for gate in ("ffn_gate_exps", "ffn_gate_shexp", "ffn_gate"):
        up = gate.replace("gate", "up", 1)
        if name.endswith(f".{up}.weight"):
            return {}
        if name.endswith(f".{gate}.weight"):
            return {hf: np.concatenate([w, read(name.replace(f".{gate}.", f".{up}."))], axis=-2)}
    if hf.endswith(".A_log"):
        return {hf: np.log(-w).reshape(-1)}
    if hf.endswith((".D", "mamba.norm.weight")):
        return {hf: w.reshape(-1)}
    if hf.endswith("conv1d.weight"):
        return {hf: w[:, None, :]}
    return {hf: w}


# llama.cpp's ``granitehybrid`` files: q and k permuted for its interleaved RoPE, as Llama's
FAMILY = Family("granite", ("granitemoehybrid",), ("granitehybrid",), granite_from_hf, GRANITE_LAYER,
                gguf_rope_permuted=True, hf_architecture="GraniteMoeHybridForCausalLM",
                gguf_config=granite_gguf, gguf_tensors=granite_tensors)
