"""Phi-3 and Phi-4-mini: Llama's block with q/k/v and gate/up stored fused, and partial rotary
(``partial_rotary_factor``); long-context RoPE (``longrope``) is refused by name for now."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twophase.arch import ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, layers_from_hf

PHI3_LAYER: LayerNames = {
    **LLAMA_LAYER,
    "attn.qkv": (("self_attn.qkv_proj",), ("attn_qkv",)),
    "mlp.gate_up": (("mlp.gate_up_proj",), ("ffn_up",)),     # llama.cpp keeps it fused as ffn_up
}


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    fields = common_fields(c)
    factor = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    rotary = int(fields["head_dim"] * float(factor))
    return ModelArch("phi3", layers=layers_from_hf(c), rotary_dim=None if rotary == fields["head_dim"] else rotary,
                     **fields)


def phi3_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """llama.cpp's Phi-3 files state the rotary width (``rope.dimension_count``) but not the
    head's, which is hidden / heads; a window of 0 is none (Phi-4-mini)."""
    head_dim = get(p + "attention.key_length") or get(p + "embedding_length") // get(p + "attention.head_count")
    return {"head_dim": head_dim,
            "partial_rotary_factor": get(p + "rope.dimension_count", head_dim) / head_dim,
            "sliding_window": get(p + "attention.sliding_window") or None}


FAMILY = Family("phi3", ("phi3",), ("phi3",), arch_from_hf, PHI3_LAYER, hf_architecture="Phi3ForCausalLM",
                gguf_config=phi3_gguf)
