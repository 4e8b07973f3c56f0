"""Gemma 2 and Gemma 3: ``(1 + w)`` norms, four a layer (after attention and after the MLP
too), an embedding scaled by sqrt(hidden), a tanh-GELU gate, a query scale from
``query_pre_attn_scalar``, sliding and global layers by ``layer_types``; Gemma 2 soft-caps
scores and logits, Gemma 3 has QK-norm and a RoPE base per layer type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twophase.arch import AttentionSpec, LayerSpec, MLPSpec, ModelArch
from twophase.errors import ModelError
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, window_of
from twophase.models.layers.rotary import check_scaling

GEMMA_LAYER: LayerNames = {
    **LLAMA_LAYER,
    "post_attn_norm": (("post_attention_layernorm",), ("post_attention_norm",)),
    "mlp_norm": (("pre_feedforward_layernorm",), ("ffn_norm",)),
    "post_mlp_norm": (("post_feedforward_layernorm",), ("post_ffw_norm",)),
}


def _plain(scaling: dict[str, Any] | None) -> None:
    """Gemma's layer types run plain RoPE here: a scaling the kit computes elsewhere is still
    refused by name, not dropped."""
    if check_scaling(scaling) is not None:
        raise ModelError(f"RoPE scaling {scaling.get('rope_type', scaling.get('type'))!r} on Gemma's "  # type: ignore[union-attr]
                         f"layers is not implemented")


def _thetas(c: dict[str, Any]) -> dict[str, float]:
    """The RoPE base of each layer type; a scaling other than plain is refused by name."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:              # transformers 5: one entry a layer type
        for p in params.values():
            _plain(p)
        return {t: float(p["rope_theta"]) for t, p in params.items()}
    _plain(c.get("rope_scaling") or params)
    full = float(c.get("rope_theta", params.get("rope_theta", 10000.0)))
    return {"full_attention": full, "sliding_attention": float(c.get("rope_local_base_freq", full))}


def arch_from_hf(c: dict[str, Any], family: str) -> ModelArch:
    if c.get("hidden_activation", c.get("hidden_act")) not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"{family}: activation {c.get('hidden_activation')!r} is not implemented")
    thetas, window, n = _thetas(c), window_of(c), c["num_hidden_layers"]
    # without layer_types: Gemma 2 alternates (sliding first); Gemma 3 slides 5 layers in 6
    pattern = c.get("sliding_window_pattern") or (6 if family == "gemma3" else 2)
    types = c.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n)]
    layers = tuple(LayerSpec(AttentionSpec(window if t == "sliding_attention" else None, thetas[t]),
                             MLPSpec(c["intermediate_size"])) for t in types[:n])
    fields = {**common_fields(c, tie_default=True), "rope_scaling": None}
    return ModelArch(family, layers=layers, norm_offset=1.0, post_norms=True, activation="gelu_tanh",
                     embed_scale=c["hidden_size"] ** 0.5, qk_norm=family == "gemma3",
                     attn_softcap=c.get("attn_logit_softcapping"), final_softcap=c.get("final_logit_softcapping"),
                     query_scale=float(c.get("query_pre_attn_scalar", fields["head_dim"])) ** -0.5, **fields)


# llama.cpp's query scale is 1/sqrt(head_dim) but for the 27B models (told apart by their layer
# count), whose query_pre_attn_scalar is hidden / heads: the files themselves do not state it
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _query_pre_attn_scalar(get: Callable[..., Any], p: str, arch: str) -> float:
    hidden, heads = get(p + "embedding_length"), get(p + "attention.head_count")
    if get(p + "block_count") == _GEMMA_27B_LAYERS[arch] and hidden and heads:
        return hidden // heads
    return get(p + "attention.key_length") or (hidden // heads if hidden and heads else 256)


def gemma2_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """What llama.cpp's Gemma 2 files state (soft-caps, the window) and what it leaves to the
    architecture: the tanh-GELU, the query scale, its defaults of caps 50 and 30 and a window of
    4096, and sliding and global layers alternating (sliding first, as without layer_types)."""
    return {"hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": float(get(p + "attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(get(p + "final_logit_softcapping", 30.0)),
            "sliding_window": get(p + "attention.sliding_window", 4096),
            "query_pre_attn_scalar": _query_pre_attn_scalar(get, p, "gemma2"),
            "sliding_window_pattern": 2}


def gemma3_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """What llama.cpp's Gemma 3 files leave to the architecture: the tanh-GELU, the query scale,
    a local RoPE base of 10,000 (unless the file states one) and five sliding layers in six (none
    where the file states no window)."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                           "sliding_window": get(p + "attention.sliding_window") or None,
                           "query_pre_attn_scalar": _query_pre_attn_scalar(get, p, "gemma3"),
                           "rope_local_base_freq": float(get(p + "rope.freq_base_swa", 10000.0)),
                           "sliding_window_pattern": 6}
    if get(p + "final_logit_softcapping"):
        out["final_logit_softcapping"] = float(get(p + "final_logit_softcapping"))
    if get(p + "rope.scaling.type") not in (None, "none"):
        out["rope_scaling"] = {"rope_type": get(p + "rope.scaling.type"), "factor": get(p + "rope.scaling.factor")}
    return out


GEMMA2 = Family("gemma2", ("gemma2",), ("gemma2",), lambda c: arch_from_hf(c, "gemma2"), GEMMA_LAYER,
                hf_architecture="Gemma2ForCausalLM", gguf_config=gemma2_gguf, gguf_norm_offset=1.0)
GEMMA3 = Family("gemma3", ("gemma3_text",), ("gemma3",), lambda c: arch_from_hf(c, "gemma3"), GEMMA_LAYER,
                hf_architecture="Gemma3ForCausalLM", gguf_config=gemma3_gguf, gguf_norm_offset=1.0)
