"""A random adapter in PEFT's format for any model this engine loads (no PEFT, no HF model
needed): what the conformance kit and the adapter benchmark run, on shapes read from the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from twophase.lora.layer import ADAPTABLE
from twophase.lora.peft_adapter import CONFIG, WEIGHTS, part_rows


def write_random_adapter(model: Any, layer_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
                         folder: str | Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                         std: float = 0.02) -> Path:
    """An adapter of ``rank`` on every dense projection of ``model`` (a ``Decoder``), A and B
    drawn with ``seed``, saved as PEFT saves one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for i, block in enumerate(model.layers):
        for ours in ADAPTABLE:
            parent_name, _, attr = ours.rpartition(".")
            module: Any = getattr(getattr(block, parent_name, None), attr, None)
            if not isinstance(getattr(module, "in_features", None), int):
                continue
            hfs = layer_names[ours][0]
            for hf, rows in zip(hfs, part_rows(module, ours, len(hfs), block)):
                key = f"base_model.model.model.layers.{i}.{hf}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * std
                targets.add(hf.rpartition(".")[2])
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(targets),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False}, indent=1))
    return folder
