"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers three in four (a recurrent state a
sequence, ``layers/deltanet.py``), gated full attention in the fourth (q_proj also gives an
output gate; QK-norm; a quarter of each head rotates), ``(1 + w)`` norms; Qwen3-Next's MLPs are
experts with a gated shared expert."""

from __future__ import annotations

from typing import Any

from twophase.arch import AttentionSpec, DeltaNetSpec, LayerSpec, MLPSpec, ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, rope_theta

_MIXER: LayerNames = {
    "mixer.conv": (("linear_attn.conv1d",), ()),
    "mixer.A_log": (("linear_attn.A_log",), ()),
    "mixer.dt_bias": (("linear_attn.dt_bias",), ()),
    "mixer.norm": (("linear_attn.norm",), ()),
    "mixer.out_proj": (("linear_attn.out_proj",), ()),
}

QWEN3_NEXT_LAYER: LayerNames = {
    **LLAMA_LAYER, **_MIXER,
    "mixer.in_proj": (("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"), ()),
    "mlp.router": (("mlp.gate",), ()),
    "mlp.experts_gate_up": (("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), ()),
    "mlp.experts_down": (("mlp.experts.{e}.down_proj",), ()),
    "mlp.shared.gate_up": (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), ()),
    "mlp.shared.down": (("mlp.shared_expert.down_proj",), ()),
    "mlp.shared_gate": (("mlp.shared_expert_gate",), ()),
}

QWEN3_5_LAYER: LayerNames = {
    **LLAMA_LAYER, **_MIXER,
    "mixer.in_proj": (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                       "linear_attn.in_proj_a"), ()),
}


def _arch(c: dict[str, Any], name: str, interleaved: bool) -> ModelArch:
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0
                                     else "linear_attention" for i in range(n)]
    mixer = DeltaNetSpec(c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                         c["linear_value_head_dim"], c.get("linear_conv_kernel_dim", 4), interleaved)
    if mixer.num_v_heads % mixer.num_k_heads:
        raise ValueError(f"linear_num_value_heads {mixer.num_v_heads} is not a multiple of "
                         f"linear_num_key_heads {mixer.num_k_heads}")
    dense = set(c.get("mlp_only_layers") or [])
    E, step = c.get("num_experts", 0), c.get("decoder_sparse_step", 1)

    def mlp(i: int) -> MLPSpec:
        if i in dense or not E or (i + 1) % step:
            return MLPSpec(c["intermediate_size"])
        return MLPSpec(c["moe_intermediate_size"], E, c["num_experts_per_tok"], bool(c.get("norm_topk_prob", True)),
                       c.get("shared_expert_intermediate_size", 0))

    attention = AttentionSpec(None, rope_theta(c))
    layers = tuple(LayerSpec(attention, mlp(i), None if t == "full_attention" else mixer)
                   for i, t in enumerate(types[:n]))
    fields = common_fields(c)
    factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    bias = bool(c.get("attention_bias", False))
    return ModelArch(name, layers=layers, qk_norm=True, qkv_bias=bias, o_bias=bias, norm_offset=1.0,
                     attn_output_gate=True, rotary_dim=int(fields["head_dim"] * factor), **fields)


def qwen3_next_from_hf(c: dict[str, Any]) -> ModelArch:
    return _arch(c, "qwen3_next", interleaved=True)


def qwen3_5_from_hf(c: dict[str, Any]) -> ModelArch:
    return _arch(c, "qwen3_5", interleaved=False)


# their GGUF files (llama.cpp's ``qwen3next``, ``qwen35``) do not load yet: no GGUF names here
QWEN3_NEXT = Family("qwen3_next", ("qwen3_next",), (), qwen3_next_from_hf, QWEN3_NEXT_LAYER,
                    hf_architecture="Qwen3NextForCausalLM")
QWEN3_5 = Family("qwen3_5", ("qwen3_5_text",), (), qwen3_5_from_hf, QWEN3_5_LAYER,
                 hf_architecture="Qwen3_5ForCausalLM")
