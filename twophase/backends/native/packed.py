"""What the native backend's two weight layouts (``weights.py``: q4; ``stored_weights.py``:
gguf) share: the tensors kept in float32, and a packed folder's arrays mapped."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def float_arrays(torch_model, layers: int) -> dict[str, np.ndarray]:
    """What both layouts keep in float32: embedding, norms (layers stacked), RoPE frequencies."""
    sd = {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}
    return {"embed": sd["embed.weight"], "final_norm": sd["norm.weight"],
            "inv_freq": torch_model.inv_freq[0].float().numpy(),
            "attn_norm": np.stack([sd[f"layers.{i}.attn_norm.weight"] for i in range(layers)]),
            "mlp_norm": np.stack([sd[f"layers.{i}.mlp_norm.weight"] for i in range(layers)])}


def mapped(folder: Path) -> dict[str, np.ndarray]:
    """A packed folder's arrays, mapped; those read every step faulted in now, not in the first
    steps (the embedding stays mapped: only the rows of tokens seen are read)."""
    a = {f.stem: np.load(f, mmap_mode="r") for f in folder.glob("*.npy")}
    for name, arr in a.items():
        if name != "embed":
            populate(arr)
    return a


def populate(arr: np.ndarray) -> None:
    """Read one byte of each page of a mapped array, so it is resident from load on (the
    embedding is left mapped: only the rows of tokens seen are ever read)."""
    flat = arr.reshape(-1).view(np.uint8)
    int(flat[::4096].sum())
