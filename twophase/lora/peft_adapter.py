"""A LoRA adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), read
and checked against the model it is to run on.

PEFT names each delta by the HF module it adapts (``model.layers.3.self_attn.k_proj``); this
engine keeps some of those fused (q, k and v in one matrix, gate and up in another). So each
delta is mapped through the family's own weight names (``Family.layer_names``, what the loader
already uses) onto one of our modules and the rows of its output that the HF module gave:
k_proj's delta adds to ``attn.qkv``'s k rows. Nothing is merged into the base weights, so many
adapters can serve one batch (``twophase.lora.layer``).

Refused, each with its reason (``AdapterError``): a missing or unreadable file, a PEFT type other
than LoRA, DoRA, trained biases, ``modules_to_save``, deltas on the embedding or the head, a
module this model does not have, a rank of 0 or past the projection's size, shapes that do not
match the model. Dropout is for training only: ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from twophase.errors import TwophaseError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


class AdapterError(TwophaseError):
    """An adapter that cannot run on this model, or be found or loaded now: the message says
    why (a server answers 404 where ``not_found``, 503 where ``busy``, else 400)."""

    def __init__(self, message: str, not_found: bool = False, busy: bool = False):
        super().__init__(message)
        self.not_found, self.busy = not_found, busy


@dataclass(frozen=True)
class LoraDelta:
    """``scale * B @ A`` added to rows ``rows`` of one module's output in one layer."""

    layer: int
    module: str                      # ours: "attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"
    rows: tuple[int, int]            # [start, stop) of the module's output rows
    a: torch.Tensor                  # [rank, in]
    b: torch.Tensor                  # [rows, rank]
    scale: float


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int                        # the largest of its deltas'
    deltas: list[LoraDelta] = field(default_factory=list)
    base_model: str | None = None    # what PEFT says it was trained on (informational)

    @property
    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.deltas)


def adapter_bytes(path: Path) -> int:
    """What an adapter's deltas take once read (float32), from its file's header alone; 0 where
    it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            return sum(4 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception:                     # missing or damaged: its load says why
        return 0


def read_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json``, checked for what this engine computes."""
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG} (is it a PEFT adapter folder?)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path / CONFIG}: cannot be read: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path / CONFIG}: not a JSON object")
    refusals = [
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r}: only LORA"),
        (bool(cfg.get("use_dora")), "use_dora: DoRA adapters are not supported"),
        (cfg.get("bias", "none") != "none", f"bias {cfg.get('bias')!r}: trained biases are not supported"),
        (bool(cfg.get("modules_to_save")), "modules_to_save: adapters that replace whole modules "
                                           f"({cfg.get('modules_to_save')}) are not supported"),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"{path}: {why}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{path}: rank r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: a key matches a module name it ends (on a dot boundary)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS))
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {WEIGHTS}") from None
    except (OSError, SafetensorError, ValueError) as exc:
        raise AdapterError(f"{path / WEIGHTS}: cannot be read (truncated?): {exc}") from None


def ours_of(layer_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> dict[str, tuple[str, int]]:
    """HF module name -> (our module, its place among the modules fused into ours)."""
    return {hf: (ours, i) for ours, (hfs, _) in layer_names.items() for i, hf in enumerate(hfs)}


def part_rows(module: Any, ours: str, parts: int, block: Any) -> list[int]:
    """The output rows of each HF module fused into ``module``: q, k, v (k and v alike, the
    query's rows the rest, its gate included), or gate and up (halves)."""
    out = int(module.out_features)
    if parts == 1:
        return [out]
    if ours == "attn.qkv" and parts == 3:
        kv = block.attn.kvh * block.attn.hd
        return [out - 2 * kv, kv, kv]
    if parts == 2:
        return [out // 2, out - out // 2]
    raise AdapterError(f"{ours}: fused from {parts} modules, which adapters do not know how to split")


def load_peft_adapter(name: str, path: str | Path, model: Any,
                      layer_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> LoraAdapter:
    """Read the adapter at ``path`` for ``model`` (a ``Decoder``), each delta checked against the
    module it adds to."""
    path = Path(path)
    cfg = read_config(path)
    tensors = _tensors(path)
    if not tensors:
        raise AdapterError(f"{path / WEIGHTS}: holds no tensors")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA delta of a decoder layer's "
                               "module (deltas on the embedding or the head are not supported)")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = t
    adapter = LoraAdapter(name, path, 0, base_model=cfg.get("base_model_name_or_path"))
    for (layer, hf), ab in sorted(pairs.items()):
        adapter.deltas.append(_delta(path, cfg, model, layer_names, layer, hf, ab))
    adapter.rank = max(d.a.shape[0] for d in adapter.deltas)
    return adapter


def _delta(path: Path, cfg: dict[str, Any], model: Any,
           layer_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
           layer: int, hf: str, ab: dict[str, torch.Tensor]) -> LoraDelta:
    where = f"{path}: layers.{layer}.{hf}"
    hf_to_ours = ours_of(layer_names)
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where}: has lora_{'A' if 'B' in ab else 'B'} without its pair")
    if hf not in hf_to_ours:
        raise AdapterError(f"{where}: this model has no module {hf!r} to adapt (adaptable: "
                           f"{', '.join(sorted(hf_to_ours))})")
    if layer >= len(model.layers):
        raise AdapterError(f"{where}: the model has {len(model.layers)} layers")
    ours, part = hf_to_ours[hf]
    block: Any = model.layers[layer]
    module: Any = block.get_submodule(ours) if _has(block, ours) else None
    if not isinstance(getattr(module, "in_features", None), int):    # an nn.Linear, wrapped or not
        raise AdapterError(f"{where}: layer {layer} computes {ours} otherwise (experts, or a "
                           f"state layer): adapters reach dense projections only")
    rows = part_rows(module, ours, len(layer_names[ours][0]), block)
    start = sum(rows[:part])
    a, b = ab["A"].float(), ab["B"].float()
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise AdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                           "make a rank-r delta")
    if a.shape[1] != module.in_features or b.shape[0] != rows[part]:
        raise AdapterError(f"{where}: a delta of {b.shape[0]} x {a.shape[1]} for a projection of "
                           f"{rows[part]} x {module.in_features}: not this model's shapes")
    if not 0 < r <= min(module.in_features, rows[part]):
        raise AdapterError(f"{where}: rank {r} must be in [1, {min(module.in_features, rows[part])}]")
    alpha = _pattern(cfg.get("alpha_pattern") or {}, hf, cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraDelta(layer, ours, (start, start + rows[part]), a.contiguous(), b.contiguous(), float(scale))


def _has(block: Any, name: str) -> bool:
    try:
        block.get_submodule(name)
        return True
    except AttributeError:
        return False

