"""DeepSeek V2 and V3: multi-head latent attention (``arch.MLASpec``: a latent a token in the
cache, no heads) and a mixture of experts with shared experts and DeepSeek's routing; the first
``first_k_dense_replace`` layers dense. V2 scores by softmax, choosing greedily or from the best
groups (a group's best score); V3 by sigmoid, choosing with a bias from the groups whose best two
biased scores sum highest, weighing by the unbiased scores, renormalised. Both scale the
weights by ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Any

from twophase.arch import AttentionSpec, LayerSpec, MLASpec, MLPSpec, ModelArch
from twophase.errors import ModelError
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, rope_theta
from twophase.models.layers.rotary import yarn_mscale

DEEPSEEK_LAYER: LayerNames = {
    **{k: v for k, v in LLAMA_LAYER.items() if k in ("attn_norm", "mlp_norm", "attn.o", "mlp.gate_up", "mlp.down")},
    "attn.q": (("self_attn.q_proj",), ("attn_q",)),
    "attn.q_a": (("self_attn.q_a_proj",), ("attn_q_a",)),
    "attn.q_a_norm": (("self_attn.q_a_layernorm",), ("attn_q_a_norm",)),
    "attn.q_b": (("self_attn.q_b_proj",), ("attn_q_b",)),
    "attn.kv_a": (("self_attn.kv_a_proj_with_mqa",), ("attn_kv_a_mqa",)),
    "attn.kv_a_norm": (("self_attn.kv_a_layernorm",), ("attn_kv_a_norm",)),
    "attn.kv_b": (("self_attn.kv_b_proj",), ("attn_kv_b",)),
    "mlp.router": (("mlp.gate",), ("ffn_gate_inp",)),
    "mlp.score_bias": (("mlp.gate.e_score_correction_bias",), ("exp_probs_b",)),
    "mlp.experts_gate_up": (("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), ("ffn_gate_exps", "ffn_up_exps")),
    "mlp.experts_down": (("mlp.experts.{e}.down_proj",), ("ffn_down_exps",)),
    "mlp.shared.gate_up": (("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                           ("ffn_gate_shexp", "ffn_up_shexp")),
    "mlp.shared.down": (("mlp.shared_experts.down_proj",), ("ffn_down_shexp",)),
}


def _experts(c: dict[str, Any], v3: bool) -> MLPSpec:
    """The routed layers' MLP; a routing mode this file does not know is refused by name."""
    method = c.get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = c.get("scoring_func", "sigmoid" if v3 else "softmax")
    known = {"noaux_tc"} if v3 else {"greedy", "group_limited_greedy"}
    if method not in known or scoring != ("sigmoid" if v3 else "softmax"):
        raise ModelError(f"DeepSeek {'V3' if v3 else 'V2'} routing {method!r} with {scoring!r} scores is not "
                         f"implemented (it routes {sorted(known)} with {'sigmoid' if v3 else 'softmax'} scores)")
    grouped = v3 or method == "group_limited_greedy"
    E, groups = c["n_routed_experts"], (c.get("n_group") or 1) if grouped else 1
    if E % groups:
        raise ModelError(f"{E} experts do not split into n_group {groups} groups")
    return MLPSpec(c["moe_intermediate_size"], E, c["num_experts_per_tok"],
                   # V2's router never renormalises (transformers' neither, whatever the key says)
                   norm_topk_prob=bool(c.get("norm_topk_prob", True)) and v3,
                   shared_intermediate_size=c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0),
                   shared_gated=False, scoring=scoring, score_bias=v3, groups=groups,
                   topk_groups=(c.get("topk_group") or 1) if grouped else 1, group_score="top2" if v3 else "max",
                   routed_scale=float(c.get("routed_scaling_factor", 1.0)))


def arch_from_hf(c: dict[str, Any], family: str) -> ModelArch:
    v3 = family == "deepseek_v3"
    if (c.get("moe_layer_freq") or 1) != 1:
        raise ModelError(f"{family}: moe_layer_freq {c['moe_layer_freq']} is not implemented (every layer past "
                         f"first_k_dense_replace routed)")
    mla = MLASpec(c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                  c.get("q_lora_rank"), bool(c.get("rope_interleave", True)))
    fields = common_fields(c)
    scaling = fields["rope_scaling"]
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scale = qk ** -0.5
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if scaling and params.get("mscale_all_dim"):      # every dimension's scale too (transformers' yarn_apply_mscale)
        scale *= yarn_mscale(scaling["factor"], params["mscale_all_dim"]) ** 2
    dense, experts = MLPSpec(c["intermediate_size"]), _experts(c, v3)
    attention = AttentionSpec(None, rope_theta(c))
    layers = tuple(LayerSpec(attention, dense if i < c.get("first_k_dense_replace", 0) else experts)
                   for i in range(c["num_hidden_layers"]))
    bias = bool(c.get("attention_bias", False))
    return ModelArch(family, layers=layers, mla=mla, qkv_bias=bias, o_bias=bias, rotary_dim=mla.qk_rope_head_dim,
                     query_scale=scale, **{**fields, "head_dim": qk, "num_kv_heads": fields["num_heads"]})


DEEPSEEK_V2 = Family("deepseek_v2", ("deepseek_v2",), (), lambda c: arch_from_hf(c, "deepseek_v2"), DEEPSEEK_LAYER,
                     hf_architecture="DeepseekV2ForCausalLM")
DEEPSEEK_V3 = Family("deepseek_v3", ("deepseek_v3",), (), lambda c: arch_from_hf(c, "deepseek_v3"), DEEPSEEK_LAYER,
                     hf_architecture="DeepseekV3ForCausalLM")
