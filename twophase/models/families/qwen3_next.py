"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers three in four (a recurrent state a
sequence, ``layers/deltanet.py``), gated full attention in the fourth (q_proj also gives an
output gate; QK-norm; a quarter of each head rotates), ``(1 + w)`` norms; Qwen3-Next's MLPs are
experts with a gated shared expert."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from twophase.arch import AttentionSpec, DeltaNetSpec, LayerSpec, MLPSpec, ModelArch
from twophase.models.families.family import LLAMA_LAYER, Family, LayerNames, common_fields, rope_theta, stated

_MIXER: LayerNames = {
    "mlp_norm": (("post_attention_layernorm",), ("post_attention_norm",)),
    "mixer.conv": (("linear_attn.conv1d",), ("ssm_conv1d",)),
    "mixer.A_log": (("linear_attn.A_log",), ("ssm_a",)),
    "mixer.dt_bias": (("linear_attn.dt_bias",), ("ssm_dt",)),
    "mixer.norm": (("linear_attn.norm",), ("ssm_norm",)),
    "mixer.out_proj": (("linear_attn.out_proj",), ("ssm_out",)),
}

QWEN3_NEXT_LAYER: LayerNames = {
    **LLAMA_LAYER, **_MIXER,
    # llama.cpp stores in_proj_qkvz as all q, k, v rows (attn_qkv) and all z rows (attn_gate)
    "mixer.in_proj": (("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"), ("attn_qkv+attn_gate", "ssm_ba")),
    "mlp.router": (("mlp.gate",), ("ffn_gate_inp",)),
    "mlp.experts_gate_up": (("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
                            ("ffn_gate_exps", "ffn_up_exps")),
    "mlp.experts_down": (("mlp.experts.{e}.down_proj",), ("ffn_down_exps",)),
    "mlp.shared.gate_up": (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                           ("ffn_gate_shexp", "ffn_up_shexp")),
    "mlp.shared.down": (("mlp.shared_expert.down_proj",), ("ffn_down_shexp",)),
    "mlp.shared_gate": (("mlp.shared_expert_gate",), ("ffn_gate_inp_shexp",)),
}

QWEN3_5_LAYER: LayerNames = {
    **LLAMA_LAYER, **_MIXER,
    "mixer.in_proj": (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                       "linear_attn.in_proj_a"), ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")),
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


def _deltanet_gguf(get: Callable[..., Any], p: str) -> dict[str, Any]:
    """The Gated DeltaNet shapes llama.cpp states as its ``ssm`` keys, the full-attention
    interval, and the rotary fraction as a rotary width."""
    v_heads = int(stated(get, p + "ssm.time_step_rank"))
    head_dim = get(p + "attention.key_length") or stated(get, p + "embedding_length") // stated(
        get, p + "attention.head_count")
    return {"linear_num_key_heads": int(stated(get, p + "ssm.group_count")),
            "linear_num_value_heads": v_heads,
            "linear_key_head_dim": int(stated(get, p + "ssm.state_size")),
            "linear_value_head_dim": int(stated(get, p + "ssm.inner_size")) // v_heads,
            "linear_conv_kernel_dim": int(stated(get, p + "ssm.conv_kernel")),
            "full_attention_interval": int(get(p + "full_attention_interval", 4)),
            "partial_rotary_factor": int(stated(get, p + "rope.dimension_count")) / head_dim}


def qwen3_next_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """The DeltaNet keys and the experts (each expert's and the shared one's width); the top k
    renormalised unless the file says otherwise."""
    return {**_deltanet_gguf(get, p),
            "num_experts": int(stated(get, p + "expert_count")),
            "num_experts_per_tok": int(stated(get, p + "expert_used_count")),
            "moe_intermediate_size": int(stated(get, p + "expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get(p + "expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": bool(get(p + "expert_weights_norm", True)),
            "mlp_only_layers": [i for i in range(int(get(p + "block_count")))
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}


def qwen3_5_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    return _deltanet_gguf(get, p)


def _shapes(get: Callable[..., Any]) -> tuple[int, int, int, int]:
    p = get("general.architecture") + "."
    nv = int(get(p + "ssm.time_step_rank"))
    return int(get(p + "ssm.group_count")), nv, int(get(p + "ssm.state_size")), int(get(p + "ssm.inner_size")) // nv


def _undo_state_tensor(hf: str, w: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter does to both families' DeltaNet tensors: it stores ``A_log`` as
    ``A = -exp(A_log)`` and the convolution ``[channels, 1, taps]`` squeezed."""
    if hf.endswith(".A_log"):
        return np.log(-w)
    if hf.endswith("conv1d.weight"):
        return w[:, None, :]
    return w


def qwen3_next_tensors(name: str, hf: str, w: np.ndarray, read: Callable[[str], np.ndarray],
                       get: Callable[..., Any]) -> dict[str, np.ndarray]:
    """in_proj_qkvz back from attn_qkv (all q rows, all k, all v) and attn_gate (all z): HF
    interleaves them a key head at a time, ``[q, k, v, z]`` each (attn_gate is read with it)."""
    if name.endswith(".attn_gate.weight"):
        return {}
    if name.endswith(".attn_qkv.weight"):
        nk, nv, dk, dv = _shapes(get)
        z = read(name.replace(".attn_qkv.", ".attn_gate."))
        q, k, v = np.split(w, [nk * dk, 2 * nk * dk])
        groups = [x.reshape(nk, -1, w.shape[-1]) for x in (q, k, v, z)]
        return {hf: np.concatenate(groups, axis=1).reshape(-1, w.shape[-1])}
    return {hf: _undo_state_tensor(hf, w)}


def _grouped(w: np.ndarray, axis: int, nk: int, head: int) -> np.ndarray:
    """V heads back from llama.cpp's tiled order (``[v0 of each key head, v1 of each, ...]``)
    to HF's, grouped by key head, along ``axis`` (heads of ``head`` elements)."""
    w = np.moveaxis(w, axis, 0)
    n = w.shape[0]
    w = w.reshape(n // (nk * head), nk, head, *w.shape[1:]).swapaxes(0, 1).reshape(n, *w.shape[1:])
    return np.moveaxis(w, 0, axis)


def qwen3_5_tensors(name: str, hf: str, w: np.ndarray, read: Callable[[str], np.ndarray],
                    get: Callable[..., Any]) -> dict[str, np.ndarray]:
    """Where there are more value heads than key heads, llama.cpp stores every V-head axis
    tiled (value rows of in_proj_qkv, in_proj_z, in_proj_b/a, A_log, dt_bias, the convolution's
    value channels, out_proj's columns): put back grouped."""
    w = _undo_state_tensor(hf, w)
    nk, nv, dk, dv = _shapes(get) if ".linear_attn." in hf else (1, 1, 0, 0)
    if nk == nv:
        return {hf: w}
    if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return {hf: np.concatenate([w[:2 * nk * dk], _grouped(w[2 * nk * dk:], 0, nk, dv)])}
    if hf.endswith("in_proj_z.weight"):
        return {hf: _grouped(w, 0, nk, dv)}
    if hf.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return {hf: _grouped(w, 0, nk, 1)}
    if hf.endswith("out_proj.weight"):
        return {hf: _grouped(w, 1, nk, dv)}
    return {hf: w}


# llama.cpp's files: ``qwen3next`` and ``qwen35``, their ``1 + w`` norms stored as 1 + w (the gated
# norm of a DeltaNet layer as it is)
QWEN3_NEXT = Family("qwen3_next", ("qwen3_next",), ("qwen3next",), qwen3_next_from_hf, QWEN3_NEXT_LAYER,
                    hf_architecture="Qwen3NextForCausalLM", gguf_config=qwen3_next_gguf, gguf_norm_offset=1.0,
                    gguf_tensors=qwen3_next_tensors)
QWEN3_5 = Family("qwen3_5", ("qwen3_5_text",), ("qwen35",), qwen3_5_from_hf, QWEN3_5_LAYER,
                 hf_architecture="Qwen3_5ForCausalLM", gguf_config=qwen3_5_gguf, gguf_norm_offset=1.0,
                 gguf_tensors=qwen3_5_tensors, hf_multimodal_type="qwen3_5")
