"""The model in the layout ``step.c`` reads: Q4_1 blocks (fp16 ``d`` and ``m``, elements ``j``
and ``j + 16`` in one byte, as GGUF stores them), a zero point per block, the outlier channels'
float32 weights, the head in Q8_0 blocks; norms, embedding and RoPE frequencies in float32.
The arrays live here; the C structs hold pointers into them."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from twophase.backends.base import ModelSpec
from twophase.backends.native.kernel import Model, ProjQ4, ProjQ8
from twophase.models.quant import BLOCK, QWeight

Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def q4_blocks(qw: QWeight) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1 blocks ``[N, K/32]`` of a 4-bit weight with a minimum, and each block's zero point
    (``QWeight.centered``: the code nearest ``-m/d``)."""
    n, k = qw.shape
    c = qw.codes.reshape(n, k // BLOCK, BLOCK)
    out = np.empty((n, k // BLOCK), Q4_1)
    out["d"], out["m"] = qw.scale, qw.minimum
    out["qs"] = c[..., :16] | (c[..., 16:] << 4)
    return out, np.ascontiguousarray(qw.centered().zeros(), dtype=np.uint8)


def q8_blocks(qw: QWeight) -> np.ndarray:
    n, k = qw.shape
    out = np.empty((n, k // BLOCK), Q8_0)
    out["d"] = qw.scale
    out["qs"] = (qw.codes.reshape(n, k // BLOCK, BLOCK).astype(np.int16) - qw.zeros()[..., None]).astype(np.int8)
    return out


@dataclass
class NativeWeights:
    model: Model
    arrays: list = field(default_factory=list)     # what the pointers point into

    @classmethod
    def build(cls, spec: ModelSpec) -> "NativeWeights":
        from twophase.exporters import q4
        from twophase.exporters.onnx import _cpu_model, calibration_ids, source_gguf
        from twophase.models.shapes import LlamaArch

        arch = LlamaArch.from_dict(spec.arch)
        torch_model = _cpu_model(spec)
        qweights = q4.model_qweights(torch_model, arch, source_gguf(spec))
        outliers = q4.outlier_channels(torch_model, calibration_ids(spec), spec.outlier_channels)
        sd = {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}
        keep: list = []

        def ptr(a: np.ndarray) -> int:
            a = np.ascontiguousarray(a)
            keep.append(a)
            return a.ctypes.data

        def proj(key: str) -> ProjQ4:
            qw = qweights[key]
            if qw.bits != 4 or qw.minimum is None:
                raise ValueError(f"{key}: the native backend runs Q4_1-style weights")
            blocks, zeros = q4_blocks(qw)
            idx = outliers.get(key, np.zeros(0, np.int64)).astype(np.int32)
            cols = qw.dequantize()[:, idx] if len(idx) else np.zeros((qw.shape[0], 0), np.float32)
            return ProjQ4(qw.shape[0], qw.shape[1], len(idx), ptr(blocks), ptr(zeros), ptr(idx),
                          ptr(cols.astype(np.float32)))

        L = arch.num_layers
        tables = {}
        for name in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            arr = (ProjQ4 * L)(*(proj(f"layers.{i}.{name}.weight") for i in range(L)))
            keep.append(arr)
            tables[name] = ctypes.cast(arr, ctypes.POINTER(ProjQ4))
        head = qweights["lm_head.weight"]
        if head.bits != 8:
            raise ValueError("the native backend runs an 8-bit head")
        model = Model(L, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                      arch.intermediate_size, arch.vocab_size, arch.rms_norm_eps,
                      ptr(sd["embed.weight"]),
                      ptr(np.stack([sd[f"layers.{i}.attn_norm.weight"] for i in range(L)])),
                      ptr(np.stack([sd[f"layers.{i}.mlp_norm.weight"] for i in range(L)])),
                      ptr(sd["norm.weight"]), ptr(torch_model.inv_freq.float().numpy()),
                      tables["attn.qkv"], tables["attn.o"], tables["mlp.gate_up"], tables["mlp.down"],
                      ProjQ8(head.shape[0], head.shape[1], ptr(q8_blocks(head))))
        return cls(model, keep)
