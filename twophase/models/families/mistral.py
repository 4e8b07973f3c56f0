"""Mistral: Llama's block with sliding-window attention on every layer."""

from __future__ import annotations

from typing import Any

from twophase.arch import ModelArch, uniform_layers
from twophase.models.families.family import LLAMA_LAYER, Family, common_fields, rope_theta, window_of


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    window = window_of(c)                      # null in Mistral 7B v0.2 on: full attention
    layers = uniform_layers(c["num_hidden_layers"], c["intermediate_size"], rope_theta(c), window)
    return ModelArch("mistral", layers=layers, **common_fields(c))


FAMILY = Family("mistral", ("mistral",), (), arch_from_hf, LLAMA_LAYER, gguf_rope_permuted=True,
                hf_architecture="MistralForCausalLM")
