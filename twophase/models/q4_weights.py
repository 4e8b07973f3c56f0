"""A model's weights as blocks of 4 bits (and its head as 8), whatever runs them: the GGUF's
own blocks where the model came from one, else its float weights quantised here; and the input
channels of each projection kept in float32 (outliers, found on a shipped calibration text).
The ONNX graph rewrite (``exporters/q4.py``) and the native backend both start from these.
"""

from __future__ import annotations

import hashlib
import logging
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from twophase.arch import ModelArch
from twophase.contract import ModelSpec
from twophase.errors import ModelError
from twophase.models.decoder import Decoder
from twophase.models.quant import QWeight

log = logging.getLogger(__name__)
PROJECTIONS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


def _calibration_text() -> str:
    return files("twophase.data").joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_digest() -> str:
    return hashlib.sha256(_calibration_text().encode()).hexdigest()[:16]


def calibration_ids(model: ModelSpec) -> list[int]:
    """``twophase/data/calibration.txt`` in the model's tokens (its bytes, for a model without
    a tokenizer: random weights)."""
    text = _calibration_text()
    folder = model.source.floats              # a GGUF's float cache holds its tokenizer
    if folder is not None and (folder / "tokenizer.json").exists():
        from twophase.models.tokenizer import HFTokenizer

        return HFTokenizer(folder).encode(text)
    return [b % model.arch.vocab_size for b in text.encode()]


def cpu_model(model: ModelSpec) -> Decoder:
    """The float model on the CPU: what the exporters trace, and what calibration runs the
    outlier channels' text through. A GGUF's is read from its float cache."""
    from twophase.models.state_dict import build_model

    source = model.source
    if source.kind != "random" and source.floats is None:
        raise ModelError(f"{model.model_id}: the float model needs the GGUF's float cache "
                         f"(WeightSource.float_cache), which this model's source lacks; load "
                         f"the model through twophase.models.loader (as the engine does)")
    return build_model(model.arch, model.dtype, torch.device("cpu"), source.floats, source.seed)


def outlier_channels(model, ids: list[int], count: int) -> dict[str, np.ndarray]:
    """The ``count`` input channels of each projection with the largest activations (max
    ``|x|``) over one prefill of ``ids`` through the float model, sorted, keyed by weight name."""
    from twophase.models.decoder import AttnMeta

    if count <= 0:
        return {}
    peak: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args, output):
            a = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0)
            peak[name] = torch.maximum(peak[name], a) if name in peak else a
        return hook

    handles = [layer.get_submodule(p).register_forward_hook(record(f"layers.{i}.{p}.weight"))
               for i, layer in enumerate(model.layers) for p in PROJECTIONS]
    arch, T, bs = model.arch, len(ids), 16
    blocks = -(-T // bs)
    pool = torch.zeros(arch.num_layers, 2, blocks, arch.num_kv_heads, bs, arch.head_dim,
                       dtype=next(model.parameters()).dtype)
    meta = AttnMeta(torch.arange(T), None, None, None, [(0, T, 0, torch.arange(blocks))])
    try:
        with torch.inference_mode():
            model(torch.tensor(ids), torch.arange(T), pool, meta)
    finally:
        for h in handles:
            h.remove()
    return {name: np.sort(p.topk(min(count, p.numel() // 2)).indices.numpy()) for name, p in peak.items()}


def model_qweights(model: Decoder | None, arch: ModelArch, gguf_path: Path | None) -> dict[str, QWeight]:
    """Quantised forms of every projection and the head, keyed by parameter name: the GGUF's
    own blocks where the model came from one (``model`` unused), else ``model``'s float weights
    quantised (projections to 4 bits, the head to 8)."""
    if gguf_path is not None:
        return gguf_qweights(gguf_path, arch)
    assert model is not None, "weights not from a GGUF are quantised from the float model"
    from twophase.models.quant import quantize_q4, quantize_q8

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {f"layers.{i}.{p}.weight": quantize_q4(sd[f"layers.{i}.{p}.weight"])
           for i in range(arch.num_layers) for p in PROJECTIONS}
    out["lm_head.weight"] = quantize_q8(sd.get("lm_head.weight", sd["embed.weight"]))
    return out


def gguf_qweights(path: Path, arch: ModelArch) -> dict[str, QWeight]:
    """The GGUF's quantised blocks as they are, fused the way the model fuses its projections
    (Q/K rows un-permuted as in the float conversion, for the families llama.cpp permutes).
    ``quantization = "q4"`` holds Q4_1 projections and a Q8_0 (or Q4_1) head: a tensor stored in
    another format is converted to those (a projection to Q4_1, the head to Q8_0) because the
    setting asks for it, and the log says which ones were."""
    from twophase.formats import by_ggml_type
    from twophase.models.families import family
    from twophase.models.gguf import unpermute_rope
    from twophase.models.gguf_file import GGUFFile
    from twophase.models.quant import from_q4_1, from_q8_0, quantize_q4, quantize_q8

    header = GGUFFile(path)
    tensors = header.tensors
    fam = family(arch.family)
    def q(name: str, head: bool = False) -> QWeight:
        import gguf

        t, data = tensors[name], header.data(name)
        k, n = t.dims
        fmt = by_ggml_type(t.ggml_type)
        kind = fmt.name if fmt else f"GGML type {t.ggml_type}"
        if kind == "Q4_1":
            return from_q4_1(data, n, k)
        if kind == "Q8_0" and head:           # a projection's blocks are 4-bit, the head's 8
            return from_q8_0(data, n, k)
        dense = gguf.quants.dequantize(data, t.ggml_type).reshape(n, k).astype(np.float32)
        return quantize_q8(dense) if head else quantize_q4(dense)     # the head at 8 bits

    def part(i: int, gguf_part: str, heads: int | None) -> QWeight:
        qw = q(f"blk.{i}.{gguf_part}.weight")
        if heads is None or not fam.gguf_rope_permuted:
            return qw
        return qw.rows(unpermute_rope(np.arange(qw.shape[0]), heads))

    rope_heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}
    out = {}
    for i in range(arch.num_layers):
        for ours in PROJECTIONS:
            parts = [part(i, g, rope_heads.get(g)) for g in fam.layer_names[ours][1]]
            out[f"layers.{i}.{ours}.weight"] = parts[0] if len(parts) == 1 else QWeight.stack(parts)
    out["lm_head.weight"] = q("output.weight" if "output.weight" in tensors else "token_embd.weight", head=True)
    return out


def say_conversions(path: Path) -> None:
    """Log the tensor types of the GGUF at ``path`` that ``"q4"`` converts (projections not in
    Q4_1, a head in neither Q4_1 nor Q8_0), at every load: packed once, converted once."""
    from twophase.formats import by_ggml_type
    from twophase.models.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    converted: dict[str, int] = {}
    for name, t in tensors.items():
        fmt = by_ggml_type(t.ggml_type)
        kind = fmt.name if fmt else f"GGML type {t.ggml_type}"
        projection = name.startswith("blk.") and name.endswith(".weight") and "norm" not in name
        if (projection and kind != "Q4_1") or (name == head and kind not in ("Q4_1", "Q8_0")):
            converted[kind] = converted.get(kind, 0) + 1
    if converted:
        log.warning("%s: quantization = \"q4\" holds Q4_1 and Q8_0 blocks; converted to them the tensors "
                    "stored as %s (quantization = \"gguf\" runs them as stored, on the native backend)",
                    path.name, ", ".join(f"{k} ({n})" for k, n in sorted(converted.items())))
