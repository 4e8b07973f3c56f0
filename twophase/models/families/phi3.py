"""Phi-3 and Phi-4-mini: Llama's block with q/k/v and gate/up stored fused, and partial rotary
(``partial_rotary_factor``); long-context RoPE (``longrope``) is refused by name for now."""

from __future__ import annotations

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


FAMILY = Family("phi3", ("phi3",), ("phi3",), arch_from_hf, PHI3_LAYER, hf_architecture="Phi3ForCausalLM")
