"""Qwen3: Llama's block with an RMSNorm over each head of q and k, and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from twophase.arch import ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, common_fields, layers_from_hf, qwen_layer_types


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    c = qwen_layer_types(c)
    bias = bool(c.get("attention_bias", False))
    return ModelArch("qwen3", layers=layers_from_hf(c), qk_norm=True, qkv_bias=bias, o_bias=bias,
                     **common_fields(c))


FAMILY = Family("qwen3", ("qwen3",), ("qwen3",), arch_from_hf, LLAMA_LAYER,
                hf_architecture="Qwen3ForCausalLM")
