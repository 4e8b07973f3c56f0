"""Llama (and SmolLM, TinyLlama, Llama 3): the plain decoder; RoPE with Llama-3 scaling."""

from __future__ import annotations

from typing import Any

from twophase.arch import ModelArch, uniform_layers
from twophase.models.families.family import LLAMA_LAYER, Family, common_fields, rope_theta


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    bias = bool(c.get("attention_bias", False))
    return ModelArch("llama", layers=uniform_layers(c["num_hidden_layers"], c["intermediate_size"], rope_theta(c)),
                     qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias", False)), **common_fields(c))


def arch(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
         num_kv_heads: int, head_dim: int, rope_theta: float = 10000.0, **kw: Any) -> ModelArch:
    """A Llama shape by its hyper-parameters (the named shapes, tests)."""
    return ModelArch("llama", vocab_size, hidden_size, num_heads, num_kv_heads, head_dim,
                     uniform_layers(num_layers, intermediate_size, rope_theta), **kw)


FAMILY = Family("llama", ("llama",), ("llama",), arch_from_hf, LLAMA_LAYER, gguf_rope_permuted=True,
                hf_architecture="LlamaForCausalLM")
