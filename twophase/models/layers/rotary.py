"""Rotary position embeddings: plain, Llama-3's long-context scaling, and partial rotary
(only the first ``rotary_dim`` of each head's dimensions turn), in HF's rotate-half convention."""

from __future__ import annotations

import math
from typing import Any

import torch

from twophase.errors import ModelError

# rope_scaling types that need no change of the frequencies
PLAIN = {None, "default"}


def check_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scaling the kit computes (Llama-3's), None for plain RoPE; any other is refused by
    name rather than ignored (a long-context model would run with the wrong frequencies)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in PLAIN:
        return None
    if kind != "llama3":
        raise ModelError(f"RoPE scaling {kind!r} is not implemented (the rotary kit computes "
                         f"plain RoPE and 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ModelError(f"RoPE scaling 'llama3' needs {', '.join(missing)}")
    return {k: scaling[k] for k in keys}


def inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """On the CPU always (a few floats), also inside a meta-device build, where arithmetic would
    run through torch's Python reference ops and import ``torch._dynamo`` (seconds)."""
    hd = rotary_dim
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    if not scaling:
        return inv
    # Llama-3: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled)


def cos_sin(positions: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 1, rotary_dim]`` each, for ``positions [T]``."""
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, 1, rotary_dim <= hd]; dimensions past rotary_dim pass."""
    rot = cos.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]
    half = rot // 2
    x1, x2 = xr[..., :half], xr[..., half:]          # slices, not chunk(): fewer graph nodes
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (xr.float() * cos + rotated.float() * sin).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)
