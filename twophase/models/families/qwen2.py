"""Qwen2 and Qwen2.5: Llama's block with biases on q, k and v (not on the output)."""

from __future__ import annotations

from typing import Any

from twophase.arch import ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, common_fields, layers_from_hf, qwen_layer_types


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    c = qwen_layer_types(c)
    return ModelArch("qwen2", layers=layers_from_hf(c), qkv_bias=True, **common_fields(c))


FAMILY = Family("qwen2", ("qwen2",), ("qwen2",), arch_from_hf, LLAMA_LAYER,
                hf_architecture="Qwen2ForCausalLM")
