"""Mixture-of-experts families: Mixtral (8 experts, top 2, renormalised) and Qwen3-MoE (many
experts, top k, renormalised or not, QK-norm; some layers may stay dense)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twophase.arch import AttentionSpec, LayerSpec, MLPSpec, ModelArch
from twophase.models.families.family import (
    LLAMA_LAYER,
    Family,
    LayerNames,
    common_fields,
    rope_theta,
    stated,
    window_of,
)

_ATTENTION = {k: v for k, v in LLAMA_LAYER.items() if k.startswith(("attn", "mlp_norm"))}

MIXTRAL_LAYER: LayerNames = {
    **_ATTENTION,
    "mlp.router": (("block_sparse_moe.gate",), ("ffn_gate_inp",)),
    "mlp.experts_gate_up": (("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3"),
                    ("ffn_gate_exps", "ffn_up_exps")),
    "mlp.experts_down": (("block_sparse_moe.experts.{e}.w2",), ("ffn_down_exps",)),
}

QWEN3_MOE_LAYER: LayerNames = {
    **LLAMA_LAYER,                       # dense layers keep Llama's MLP names
    "mlp.router": (("mlp.gate",), ("ffn_gate_inp",)),
    "mlp.experts_gate_up": (("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), ("ffn_gate_exps", "ffn_up_exps")),
    "mlp.experts_down": (("mlp.experts.{e}.down_proj",), ("ffn_down_exps",)),
}


def mixtral_from_hf(c: dict[str, Any]) -> ModelArch:
    mlp = MLPSpec(c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"], True)
    layer = LayerSpec(AttentionSpec(window_of(c), rope_theta(c)), mlp)
    return ModelArch("mixtral", layers=(layer,) * c["num_hidden_layers"], **common_fields(c))


def qwen3_moe_from_hf(c: dict[str, Any]) -> ModelArch:
    dense = set(c.get("mlp_only_layers") or [])
    step, E = c.get("decoder_sparse_step", 1), c.get("num_experts", c.get("num_local_experts", 0))
    attention = AttentionSpec(None, rope_theta(c))

    def mlp(i: int) -> MLPSpec:
        if i in dense or not E or (i + 1) % step:
            return MLPSpec(c["intermediate_size"])
        return MLPSpec(c["moe_intermediate_size"], E, c["num_experts_per_tok"], bool(c.get("norm_topk_prob")))

    bias = bool(c.get("attention_bias", False))
    return ModelArch("qwen3_moe", layers=tuple(LayerSpec(attention, mlp(i)) for i in range(c["num_hidden_layers"])),
                     qk_norm=True, qkv_bias=bias, o_bias=bias, **common_fields(c))


def mixtral_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """llama.cpp writes Mixtral as ``llama`` with expert counts; each expert is as wide as
    ``feed_forward_length``."""
    return {"num_local_experts": int(get(p + "expert_count")),
            "num_experts_per_tok": int(get(p + "expert_used_count", 2))}


def qwen3_moe_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """The expert counts and width; llama.cpp renormalises the top k unless the file says
    otherwise (``expert_weights_norm``); a layer without a router is dense (``mlp_only_layers``)."""
    n = int(get(p + "block_count"))
    return {"num_experts": int(stated(get, p + "expert_count")),
            "num_experts_per_tok": int(stated(get, p + "expert_used_count")),
            "moe_intermediate_size": int(stated(get, p + "expert_feed_forward_length")),
            "norm_topk_prob": bool(get(p + "expert_weights_norm", True)),
            "mlp_only_layers": [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}


# Mixtral's files say ``llama``: it is the family for those that state an expert count
MIXTRAL = Family("mixtral", ("mixtral",), ("llama",), mixtral_from_hf, MIXTRAL_LAYER, gguf_rope_permuted=True,
                 hf_architecture="MixtralForCausalLM", gguf_config=mixtral_gguf, gguf_experts=True)
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), ("qwen3moe",), qwen3_moe_from_hf, QWEN3_MOE_LAYER,
                   hf_architecture="Qwen3MoeForCausalLM", gguf_config=qwen3_moe_gguf, gguf_experts=True)
