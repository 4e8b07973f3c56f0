"""What the native backend's two weight layouts (``weights.py``: q4; ``stored_weights.py``:
gguf) share: the tensors kept in float32, and a packed folder's arrays loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twophase.contract import ModelSpec
from twophase.large_pages import region
from twophase.models.decoder import Decoder, rope_inv_freq, rope_thetas

# per layer, the float32 tensors a family may add: array name -> the Decoder's parameter
OPTIONAL = {"q_norm": "attn.q_norm.weight", "k_norm": "attn.k_norm.weight",
            "post_attn_norm": "post_attn_norm.weight", "post_mlp_norm": "post_mlp_norm.weight",
            "qkv_bias": "attn.qkv.bias", "o_bias": "attn.o.bias", "gate_up_bias": "mlp.gate_up.bias",
            "down_bias": "mlp.down.bias", "sinks": "attn.sinks", "router_bias": "mlp.router.bias",
            "exp_gu_bias": "mlp.experts_gate_up.bias", "exp_dn_bias": "mlp.experts_down.bias"}
NORMS = {"attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"}


PER_LAYER = {"attn_norm": "attn_norm.weight", "mlp_norm": "mlp_norm.weight", **OPTIONAL}


def kept_in_float(name: str) -> bool:
    """Whether the model's tensor ``name`` is one both layouts keep in float32."""
    return name in ("embed.weight", "norm.weight") or name.split(".", 2)[-1] in PER_LAYER.values()


def float_arrays(spec: ModelSpec, model: Decoder | None = None) -> dict[str, np.ndarray]:
    """What both layouts keep in float32: embedding, norms and biases (layers stacked), each
    layer's RoPE frequencies. The tensors are read by the family's table from where the weights
    lie (``float_weights``; random ones from ``model``, the Decoder that drew them, if given). A
    ``(1 + w)`` norm is stored as ``1 + w`` (in float32, as the family computes it), so the C step
    has one RMSNorm."""
    from twophase.models.state_dict import float_weights

    arch, layers = spec.arch, spec.arch.num_layers
    sd = {k: v.numpy() for k, v in float_weights(spec, kept_in_float, model).items()}
    thetas = rope_thetas(arch)
    rope_index = [thetas.index(s.attention.rope_theta) for s in arch.layers]
    out = {"embed": sd["embed.weight"], "final_norm": sd["norm.weight"],
           "inv_freq": rope_inv_freq(arch)[rope_index].float().numpy()}
    out.update({name: np.stack([sd[f"layers.{i}.{p}"] for i in range(layers)])
                for name, p in PER_LAYER.items() if f"layers.0.{p}" in sd})
    offset = np.float32(arch.norm_offset)
    return {k: (v + offset if k in NORMS and offset else v) for k, v in out.items()}


def shared_fields(arch, a: dict[str, np.ndarray]) -> dict:
    """The ``Model`` struct's fields both layouts set alike, by name: the shapes, and pointers
    into the packed float32 arrays ``a``."""
    return {"layers": arch.num_layers, "dim": arch.hidden_size, "heads": arch.num_heads,
            "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "ffn": arch.intermediate_size,
            "vocab": arch.vocab_size, "eps": arch.rms_norm_eps,
            **{n: a[n].ctypes.data for n in ("embed", "attn_norm", "mlp_norm", "final_norm", "inv_freq")}}


def set_arch(model, arch, a: dict[str, np.ndarray]) -> None:
    """The ``Model`` struct's fields for the family's departures from the Llama block, pointing
    into the packed arrays ``a`` (the pool's slots and groups are the backend's, at bind)."""
    model.rot_dim = arch.rotary_dim or arch.head_dim
    model.scale = arch.scale
    model.embed_scale = arch.embed_scale
    model.attn_cap = arch.attn_softcap or 0.0
    model.final_cap = arch.final_softcap or 0.0
    model.act = {"silu": 0, "gelu_tanh": 1, "clamped_swiglu": 2}[arch.activation]
    model.glu_alpha, model.glu_limit = arch.swiglu_alpha, arch.swiglu_limit
    a["window"] = np.array([s.attention.window or 0 for s in arch.layers], np.int32)
    model.window = a["window"].ctypes.data
    for name in OPTIONAL:
        setattr(model, name, a[name].ctypes.data if name in a else None)


def loaded(folder: Path) -> dict[str, np.ndarray]:
    """A packed folder's arrays: those read every step copied into one region of large pages
    (``arena``), the embedding left mapped (only the rows of tokens seen are read)."""
    a = {f.stem: np.load(f, mmap_mode="r") for f in folder.glob("*.npy")}
    embed = a.pop("embed")
    return {**arena(a), "embed": embed}


# each array of the arena at a page boundary of its own
ALIGN = 4096


def arena(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of ``arrays`` in one region on large pages where the OS gives them
    (``twophase.large_pages``: a step streams them all), each at a 4 KB boundary."""
    offsets, size = {}, 0
    for name, arr in arrays.items():
        offsets[name] = size
        size += -(-arr.nbytes // ALIGN) * ALIGN
    raw = region(size)
    out = {}
    for name, arr in arrays.items():
        view = raw[offsets[name]:offsets[name] + arr.nbytes].view(arr.dtype).reshape(arr.shape)
        view[...] = arr
        out[name] = view
    return out
