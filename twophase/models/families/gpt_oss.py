"""gpt-oss: a mixture of experts (top k over a biased router, every expert biased, a clamped
SwiGLU) under attention with q/k/v and output biases and sinks, sliding (128) and full layers
alternating, YaRN RoPE.

Its checkpoints store each layer's experts as one stacked tensor a matrix, transposed against
ours (``[E, in, out]``) with gate and up interleaved column by column, and the biases beside them
as ``*_bias``: the layouts below turn them into ours and back. The published checkpoints hold the
experts' matrices in MXFP4 (``*_blocks``: two 4-bit E2M1 codes a byte, 32 values a block;
``*_scales``: a block's E8M0 exponent), which ``unpack_mxfp4`` turns into that float form, exact
in bfloat16 (a code has one mantissa bit, the scale is a power of two).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from twophase.arch import AttentionSpec, LayerSpec, MLPSpec, ModelArch
from twophase.errors import ModelError
from twophase.models.families.family import (
    LLAMA_LAYER,
    Family,
    LayerNames,
    Layout,
    common_fields,
    rope_theta,
    stated,
)
from twophase.models.lazy_tensors import LazyTensors, lazily

GPT_OSS_LAYER: LayerNames = {
    **{k: v for k, v in LLAMA_LAYER.items() if k in ("attn_norm", "attn.qkv", "attn.o")},
    "mlp_norm": (("post_attention_layernorm",), ("post_attention_norm",)),
    "attn.sinks": (("self_attn.sinks",), ("attn_sinks",)),
    "mlp.router": (("mlp.router",), ("ffn_gate_inp",)),
    "mlp.experts_gate_up": (("mlp.experts.gate_up_proj",), ("ffn_gate_exps+ffn_up_exps",)),
    "mlp.experts_down": (("mlp.experts.down_proj",), ("ffn_down_exps",)),
}

_STORED = {f"mlp.experts.{m}.{k}": f"mlp.experts.{m}" + ("_bias" if k == "bias" else "")
           for m in ("gate_up_proj", "down_proj") for k in ("weight", "bias")}


def _split_pairs(t: torch.Tensor) -> torch.Tensor:
    """Interleaved gate and up (``g0 u0 g1 u1 ...`` along the last axis) → gate's then up's."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    f = t.shape[-1] // 2
    return torch.stack([t[..., :f], t[..., f:]], dim=-1).flatten(-2)


def _t(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous()


_LAYOUTS: dict[str, Layout] = {
    # [E, h, 2f] interleaved -> [E, 2f, h], gate's rows then up's
    "mlp.experts_gate_up.weight": (lambda t: _t(_split_pairs(t)), lambda t: _interleave(_t(t))),
    "mlp.experts_gate_up.bias": (_split_pairs, _interleave),
    "mlp.experts_down.weight": (_t, _t),                   # [E, f, h] -> [E, h, f]
}


# E2M1: a sign bit, two exponent bits, one mantissa bit; code 8 is -0
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [E, rows, G, 16]`` (uint8, the low nibble the first of a pair) under ``scales
    [E, rows, G]`` (``2 ** (s - 127)``) → ``[E, rows, G * 32]``, one expert at a time (the codes'
    indices would take 8 bytes a value of a whole layer)."""
    lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    for e in range(blocks.shape[0]):
        b = blocks[e]
        values = lut[torch.stack([b & 0x0F, b >> 4], dim=-1).int()].flatten(-2)         # [rows, G, 32]
        exps = scales[e].to(torch.int32).unsqueeze(-1) - 127
        out[e] = torch.ldexp(values, exps).flatten(-2).to(dtype)
    return out


def unpack_mxfp4(hf: Mapping[str, torch.Tensor]) -> LazyTensors:
    """A checkpoint's ``X_blocks`` and ``X_scales`` ([E, out, in / 32, 16] and [E, out, in / 32])
    as the float checkpoint's ``X`` (``[E, in, out]``), dequantised when read; the other tensors
    as they are."""
    hf = lazily(hf)
    makers = {}
    for k in hf:
        base = k.removesuffix("_blocks").removesuffix("_scales")
        if k.endswith(("_blocks", "_scales")) and (base + "_blocks" not in hf or base + "_scales" not in hf):
            half = "_scales" if k.endswith("_blocks") else "_blocks"
            raise ModelError(f"{k} has no {base}{half} beside it: not an MXFP4 checkpoint as gpt-oss's")
        if k.endswith("_blocks"):
            makers[base] = partial(_dequantized, hf.maker(k), hf.maker(base + "_scales"), base)
        elif not k.endswith("_scales"):
            makers[k] = hf.maker(k)
    return LazyTensors(makers)


def _dequantized(blocks: Callable[[], torch.Tensor], scales: Callable[[], torch.Tensor], name: str) -> torch.Tensor:
    s = scales()
    if bool((s == 255).any()):
        raise ModelError(f"{name}_scales holds 255, E8M0's NaN: the checkpoint is damaged")
    return mxfp4_dequantize(blocks(), s).transpose(1, 2)


def arch_from_hf(c: dict[str, Any]) -> ModelArch:
    method = (c.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ModelError(f"gpt-oss checkpoints quantized with {method!r} are not read here: load its "
                         f"MXFP4 or bf16 form, or its GGUF")
    n, window = c["num_hidden_layers"], c.get("sliding_window") or 128
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    mlp = MLPSpec(c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"], True)
    layers = tuple(LayerSpec(AttentionSpec(window if t == "sliding_attention" else None, rope_theta(c, 150000.0)),
                             mlp) for t in types[:n])
    bias = bool(c.get("attention_bias", True))
    return ModelArch("gpt_oss", layers=layers, qkv_bias=bias, o_bias=bias, mlp_bias=True, attn_sinks=True,
                     activation="clamped_swiglu", swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(c.get("swiglu_limit", 7.0)), **common_fields(c))


def gpt_oss_gguf(get: Callable[..., Any], p: str, tensors: frozenset[str]) -> dict[str, Any]:
    """What llama.cpp's ``gpt-oss`` files state (the experts, the window, YaRN) and leave to the
    architecture: sliding and full layers alternating, sliding first."""
    n = int(stated(get, p + "block_count"))
    out: dict[str, Any] = {
        "num_local_experts": int(stated(get, p + "expert_count")),
        "num_experts_per_tok": int(stated(get, p + "expert_used_count")),
        "intermediate_size": int(get(p + "expert_feed_forward_length") or stated(get, p + "feed_forward_length")),
        "sliding_window": int(get(p + "attention.sliding_window", 128)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "attention_bias": "blk.0.attn_q.bias" in tensors}
    if get(p + "rope.scaling.type") == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(stated(get, p + "rope.scaling.factor")),
                               "original_max_position_embeddings":
                                   int(stated(get, p + "rope.scaling.original_context_length")),
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    return out


def gpt_oss_tensors(name: str, hf: str, w: np.ndarray, read: Callable[[str], np.ndarray],
                    get: Callable[..., Any]) -> dict[str, np.ndarray]:
    """llama.cpp stores the experts' gate and up apart, each ``[E, f, h]`` (read back at the
    gate's, interleaved and transposed as the checkpoints hold them), and down as ``[E, h, f]``."""
    if ".ffn_up_exps." in name:
        return {}
    if ".ffn_gate_exps." in name:
        up = read(name.replace(".ffn_gate_exps.", ".ffn_up_exps."))
        pairs = np.stack([w, up], axis=-2 if name.endswith(".weight") else -1)     # [E, f, 2, h] / [E, f, 2]
        joined = pairs.reshape(*w.shape[:-2], -1, w.shape[-1]) if name.endswith(".weight") else pairs.reshape(
            w.shape[0], -1)
        return {hf: np.swapaxes(joined, -1, -2) if name.endswith(".weight") else joined}
    if ".ffn_down_exps.weight" in name:
        return {hf: np.swapaxes(w, -1, -2)}
    return {hf: w}


FAMILY = Family("gpt_oss", ("gpt_oss",), ("gpt-oss",), arch_from_hf, GPT_OSS_LAYER,
                hf_architecture="GptOssForCausalLM", gguf_config=gpt_oss_gguf, gguf_experts=True,
                gguf_tensors=gpt_oss_tensors, hf_stored_names=_STORED, hf_layouts=_LAYOUTS,
                hf_unpack=unpack_mxfp4)
