"""LFM2 (Liquid AI): gated short-convolution layers (a convolution state a sequence,
``layers/short_conv.py``) mixed with GQA attention layers with QK-norm, the Llama block's
pre-norm residual order otherwise; the final norm is named ``embedding_norm``, the embedding
tied by default, and the MLP width derived from ``intermediate_size`` as HF derives it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from twophase.arch import AttentionSpec, LayerSpec, MLPSpec, ModelArch, ShortConvSpec
from twophase.models.families.family import TOP_NAMES, Family, LayerNames, common_fields, rope_theta, stated

LFM2_LAYER: LayerNames = {
    "attn_norm": (("operator_norm",), ("attn_norm",)),
    "mlp_norm": (("ffn_norm",), ("ffn_norm",)),
    "attn.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("attn_q", "attn_k", "attn_v")),
    "attn.o": (("self_attn.out_proj",), ("attn_output",)),
    "attn.q_norm": (("self_attn.q_layernorm",), ("attn_q_norm",)),
    "attn.k_norm": (("self_attn.k_layernorm",), ("attn_k_norm",)),
    "mixer.in_proj": (("conv.in_proj",), ("shortconv.in_proj",)),
    "mixer.conv": (("conv.conv",), ("shortconv.conv",)),
    "mixer.out_proj": (("conv.out_proj",), ("shortconv.out_proj",)),
    "mlp.gate_up": (("feed_forward.w1", "feed_forward.w3"), ("ffn_gate", "ffn_up")),
    "mlp.down": (("feed_forward.w2",), ("ffn_down",)),
}


def mlp_width(c: dict[str, Any]) -> int:
    """HF's ``Lfm2MLP``: ``block_ff_dim`` (or ``intermediate_size``), with
    ``block_auto_adjust_ff_dim`` two thirds of it, times ``block_ffn_dim_multiplier``, rounded
    up to a multiple of ``block_multiple_of``."""
    f = c["block_ff_dim"] if "block_ff_dim" in c else c["intermediate_size"]
    if c.get("block_auto_adjust_ff_dim", True):
        f = int(2 * f / 3)
        mult = c.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            m = c.get("block_multiple_of", 256)
            f = m * ((int(mult * f) + m - 1) // m)
    return f


def lfm2_from_hf(c: dict[str, Any]) -> ModelArch:
    n = c["num_hidden_layers"]
    attn = c.get("full_attn_idxs")
    types = c.get("layer_types") or ["full_attention" if attn is None or i in attn else "conv" for i in range(n)]
    mixer = ShortConvSpec(c["hidden_size"], c.get("conv_L_cache", 3), bool(c.get("conv_bias", False)))
    attention, mlp = AttentionSpec(None, rope_theta(c, 1e6)), MLPSpec(mlp_width(c))
    layers = tuple(LayerSpec(attention, mlp, mixer if t == "conv" else None) for t in types[:n])
    fields = common_fields(c, tie_default=True)
    fields["tie_word_embeddings"] = bool(c.get("tie_embedding", fields["tie_word_embeddings"]))
    fields["rms_norm_eps"] = float(c.get("norm_eps", 1e-5))
    return ModelArch("lfm2", layers=layers, qk_norm=True, **fields)


def lfm2_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """llama.cpp states the key-value heads a layer, 0 for a convolution layer; the MLP width as
    derived (so not derived again); the convolution's taps, and its biases by their tensors."""
    kv = stated(get, p + "attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * int(stated(get, p + "block_count"))
    return {"layer_types": ["conv" if k == 0 else "full_attention" for k in kv],
            "block_auto_adjust_ff_dim": False,
            "conv_L_cache": int(stated(get, p + "shortconv.l_cache")),
            "conv_bias": any(t.endswith(".shortconv.in_proj.bias") for t in tensors),
            "norm_eps": float(get(p + "attention.layer_norm_rms_epsilon", 1e-5))}


def lfm2_tensors(name: str, hf: str, w: np.ndarray, read: Callable[[str], np.ndarray],
                 get: Callable[..., Any]) -> dict[str, np.ndarray]:
    """llama.cpp stores the convolution ``[channels, 1, taps]`` squeezed."""
    return {hf: w[:, None, :] if hf.endswith("conv.conv.weight") else w}


FAMILY = Family("lfm2", ("lfm2",), ("lfm2",), lfm2_from_hf, LFM2_LAYER, hf_architecture="Lfm2ForCausalLM",
                hf_top_names={**{o: hf for o, (hf, _) in TOP_NAMES.items()}, "norm": "model.embedding_norm"},
                gguf_top_names={**{o: g for o, (_, g) in TOP_NAMES.items()}, "norm": "token_embd_norm"},
                gguf_config=lfm2_gguf, gguf_tensors=lfm2_tensors)
