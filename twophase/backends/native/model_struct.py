"""The model in the layout ``step.c`` reads: each projection row its Q4_1 blocks' fp16 ``d`` and
``m``, a zero point per block and the 4-bit codes (21 bytes a block), the codes regrouped by
groups of 16 blocks so that one 32-bit lane holds one block (``q4_rows``); the outlier channels'
float32 weights; the head's Q8_0 blocks regrouped likewise (``q8_rows``, 34 bytes a block);
norms, embedding and RoPE frequencies in float32. The arrays live here; the C structs hold
pointers into them.

The GGUF's own blocks are taken exactly. Weights quantised here (HF folders, random weights)
have float32 ``d`` and ``m``, which the fp16 fields round (by at most 2^-11 of each): for them
this backend computes a model a rounding away from the onnxruntime backend's q4."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twophase.backends.native.kernel import Model, ProjQ4, ProjQ8
from twophase.backends.native.packed import float_arrays, loaded, set_arch, shared_fields
from twophase.contract import ModelSpec
from twophase.models.q4_weights import (
    PROJECTIONS,
    calibration_digest,
    calibration_ids,
    cpu_model,
    model_qweights,
    outlier_channels,
)
from twophase.models.quant import BLOCK, QWeight

log = logging.getLogger(__name__)

# each projection's field in ``Model`` (``s_`` before it: the stored layout's)
PROJ_FIELDS = {"attn.qkv": "qkv", "attn.o": "o", "mlp.gate_up": "gate_up", "mlp.down": "down"}
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


GROUP = 16      # blocks a group: one zmm's 32-bit lanes (a ymm takes half a group at a time)


def lanes(words: np.ndarray) -> np.ndarray:
    """``[n, nb, W, 4]`` bytes (W 4-byte words a block) in the kernels' group order: per whole
    group of 16 blocks, W vectors of 16 lanes, lane j of vector k block j's word k; the last
    ``nb % 16`` blocks after them as they are. ``[n, nb * W * 4]``."""
    n, nb, W, _ = words.shape
    G = nb // GROUP
    full = words[:, :GROUP * G].reshape(n, G, GROUP, W, 4).transpose(0, 1, 3, 2, 4).reshape(n, G * GROUP * 4 * W)
    return np.concatenate([full, words[:, GROUP * G:].reshape(n, -1)], axis=1)


def q4_rows(blocks: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Rows of 21 bytes a block, as ``step.c`` streams them: ``d[nb]`` fp16, ``m[nb]`` fp16,
    ``z[nb]``, then the GGUF's code bytes ``qs`` (low nibbles elements 0-15, high 16-31) by
    ``lanes``. The same bytes as the blocks and zero points, in another order."""
    n, nb = blocks.shape
    d = np.ascontiguousarray(blocks["d"]).view(np.uint8).reshape(n, 2 * nb)
    m = np.ascontiguousarray(blocks["m"]).view(np.uint8).reshape(n, 2 * nb)
    codes = lanes(np.ascontiguousarray(blocks["qs"]).reshape(n, nb, 4, 4))
    return np.concatenate([d, m, zeros.reshape(n, nb).astype(np.uint8), codes], axis=1)


def q8_rows(blocks: np.ndarray) -> np.ndarray:
    """The head's rows, 34 bytes a block: ``d[nb]`` fp16, then the codes by ``lanes``: + 128
    (unsigned) in the whole groups, as they are (signed) in the last ``nb % 16`` blocks."""
    n, nb = blocks.shape
    d = np.ascontiguousarray(blocks["d"]).view(np.uint8).reshape(n, 2 * nb)
    qs = np.ascontiguousarray(blocks["qs"]).view(np.uint8).reshape(n, nb, 32)
    whole = nb // GROUP * GROUP
    u = qs.copy()
    u[:, :whole] ^= 0x80                    # q + 128 as an unsigned byte
    return np.concatenate([d, lanes(u.reshape(n, nb, 8, 4))], axis=1)


def q8_blocks(qw: QWeight) -> np.ndarray:
    n, k = qw.shape
    out = np.empty((n, k // BLOCK), Q8_0)
    out["d"] = qw.scale
    out["qs"] = (qw.codes.reshape(n, k // BLOCK, BLOCK).astype(np.int16) - qw.zeros()[..., None]).astype(np.int8)
    return out


FORMAT = "twophase-native/5"     # 5: the families' arrays; 4: groups of 16 blocks (3: of 8)


def manifest(spec: ModelSpec) -> dict:
    from twophase.exporters.cache import weights_digest

    return {"format": FORMAT, "model_id": spec.model_id, "arch": spec.arch.to_dict(),
            "weights_sha256": weights_digest(spec), "from_gguf": spec.source.kind == "gguf",
            "outlier_channels": spec.outlier_channels, "calibration_sha256": calibration_digest()}


def pack(spec: ModelSpec, folder: Path) -> None:
    """Write the model's arrays to ``folder``, one ``.npy`` each (layers stacked)."""
    arch, gguf = spec.arch, spec.source.gguf
    # the float model, where it is needed: to quantise weights that are not a GGUF's blocks, and
    # to find the outlier channels by running the calibration text's activations through it
    need_float = gguf is None or spec.outlier_channels > 0
    torch_model = cpu_model(spec) if need_float else None
    qweights = model_qweights(torch_model, arch, gguf)
    outliers = outlier_channels(torch_model, calibration_ids(spec), spec.outlier_channels) \
        if torch_model is not None else {}
    out = float_arrays(spec, torch_model)
    L = arch.num_layers
    for name in PROJECTIONS:
        parts = {"rows": [], "idx": [], "cols": []}
        for i in range(L):
            key = f"layers.{i}.{name}.weight"
            qw = qweights[key]
            if qw.bits != 4 or qw.minimum is None:
                raise ValueError(f"{key}: the native backend runs Q4_1-style weights")
            blocks, zeros = q4_blocks(qw)
            idx = outliers.get(key, np.zeros(0, np.int64)).astype(np.int32)
            parts["rows"].append(q4_rows(blocks, zeros))
            parts["idx"].append(idx)
            parts["cols"].append(qw.dequantize()[:, idx].astype(np.float32))
        out.update({f"{name}.{k}": np.stack(v) for k, v in parts.items()})
    head = qweights["lm_head.weight"]
    if head.bits != 8:                  # a file's Q4_1 head: the tiles run an 8-bit one
        from twophase.models.quant import quantize_q8

        log.warning("%s: the native backend runs its 4-bit head as Q8_0 (converted once, here)", spec.model_id)
        head = quantize_q8(head.dequantize())
    out["head"] = q8_rows(q8_blocks(head))
    for name, a in out.items():
        np.save(folder / f"{name}.npy", np.ascontiguousarray(a))


@dataclass
class NativeWeights:
    model: Model
    arrays: dict = field(default_factory=dict)     # what the pointers point into
    tables: list = field(default_factory=list)

    @classmethod
    def build(cls, spec: ModelSpec) -> "NativeWeights":
        """The model's arrays, packed once (``$TWOPHASE_CACHE/native``) and loaded from there (``packed.loaded``)."""
        from twophase.exporters.cache import build_cached, cache_folder

        if spec.quantization == "gguf":
            return cls.build_stored(spec)

        man = manifest(spec)
        folder = cache_folder("native", man)
        build_cached(folder, man, lambda tmp: pack(spec, tmp), what="native weights")
        a = loaded(folder)
        arch = spec.arch
        L = arch.num_layers

        def ptr(name: str, *index) -> int:
            return a[name][index].ctypes.data if index else a[name].ctypes.data

        tables = {}
        for name in PROJECTIONS:
            rows = a[f"{name}.rows"]
            n, nb, n_out = rows.shape[1], rows.shape[2] // 21, a[f"{name}.idx"].shape[1]
            arr = (ProjQ4 * L)(*(ProjQ4(n=n, k=nb * BLOCK, n_out=n_out, w=ptr(f"{name}.rows", i),
                                        out_idx=ptr(f"{name}.idx", i), out_w=ptr(f"{name}.cols", i))
                                 for i in range(L)))
            tables[name] = arr
        head = a["head"]
        if head.shape[0] != arch.vocab_size or a["embed"].shape != (arch.vocab_size, arch.hidden_size) \
                or head.shape[1] * BLOCK != 34 * arch.hidden_size:
            raise ValueError(f"packed weights in {folder} do not match the model's shapes")
        model = Model(**shared_fields(arch, a), head=ProjQ8(n=head.shape[0], k=arch.hidden_size, w=ptr("head")),
                      **{PROJ_FIELDS[n]: ctypes.cast(tables[n], ctypes.POINTER(ProjQ4)) for n in PROJECTIONS})
        set_arch(model, arch, a)
        return cls(model, a, list(tables.values()))

    @classmethod
    def build_stored(cls, spec: ModelSpec) -> "NativeWeights":
        """``quantization = "gguf"``: the file's tensors as stored (``stored_weights``)."""
        import json

        from twophase.backends.native import stored_weights
        from twophase.backends.native.kernel import Part, ProjStored
        from twophase.exporters.cache import build_cached, cache_folder, weights_digest
        from twophase.formats import FORMATS

        stored_weights.gguf_of(spec)           # refused before anything is built
        man = {"format": stored_weights.FORMAT, "model_id": spec.model_id, "arch": spec.arch.to_dict(),
               "weights_sha256": weights_digest(spec)}
        folder = cache_folder("native", man)
        build_cached(folder, man, lambda tmp: stored_weights.pack(spec, tmp), what="native weights as stored")
        a = loaded(folder)
        types = json.loads((folder / "types.json").read_text())
        arch, L = spec.arch, spec.arch.num_layers

        def proj(key: str, k: int, experts: int = 1, e: int = 0) -> ProjStored:
            """``key``'s parts (of ``experts`` stacked, expert ``e``'s rows); none if not packed."""
            parts = []
            for j, t in enumerate(types.get(key, ())):
                rows, fmt = a[f"{key}.{j}"], FORMATS[t]
                if rows.shape[1] != fmt.bytes_for((1, k)) or rows.shape[0] % experts:
                    raise ValueError(f"packed weights in {folder}: {key}'s rows of {rows.shape[1]} bytes "
                                     f"are not {k} {t} values")
                n = rows.shape[0] // experts
                parts.append(Part(type=fmt.ggml_type, n=n, w=rows[e * n:(e + 1) * n].ctypes.data))
            return ProjStored(n=sum(p.n for p in parts), k=k, parts=len(parts), part=(Part * 3)(*parts))

        D, F, E = arch.hidden_size, arch.intermediate_size, arch.layers[0].mlp.num_experts
        widths = {"attn.qkv": D, "attn.o": arch.num_heads * arch.head_dim, "mlp.gate_up": D, "mlp.down": F}
        tables = {n: (ProjStored * L)(*(proj(f"layers.{i}.{n}", widths[n]) for i in range(L))) for n in PROJECTIONS}
        if E:                                   # expert layers: each expert's share of the stacked rows
            tables["mlp.router"] = (ProjStored * L)(*(proj(f"layers.{i}.mlp.router", D) for i in range(L)))
            for name, k in (("mlp.experts_gate_up", D), ("mlp.experts_down", F)):
                tables[name] = (ProjStored * (L * E))(*(proj(f"layers.{i}.{name}", k, E, e)
                                                        for i in range(L) for e in range(E)))
            rows = {"mlp.router": E, "mlp.experts_gate_up": 2 * F, "mlp.experts_down": D}
            if any(p.n != rows[n] for n in rows for p in tables[n]):
                raise ValueError(f"packed weights in {folder}: the experts' tensors do not match "
                                 f"{E} experts of width {F}")
        head = proj("lm_head", D)
        if head.n != arch.vocab_size or a["embed"].shape != (arch.vocab_size, D):
            raise ValueError(f"packed weights in {folder} do not match the model's shapes")
        model = Model(**shared_fields(arch, a), stored=1, s_head=ctypes.pointer(head),      # the q4 fields NULL
                      **{f"s_{PROJ_FIELDS[n]}": ctypes.cast(tables[n], ctypes.POINTER(ProjStored))
                         for n in PROJECTIONS})
        set_arch(model, arch, a)
        if E:
            mlp = arch.layers[0].mlp
            model.experts, model.top_k, model.norm_topk = E, mlp.top_k, int(mlp.norm_topk_prob)
            model.s_router, model.s_exp_gu, model.s_exp_dn = (
                ctypes.cast(tables[n], ctypes.POINTER(ProjStored))
                for n in ("mlp.router", "mlp.experts_gate_up", "mlp.experts_down"))
        return cls(model, a, [*tables.values(), head])
