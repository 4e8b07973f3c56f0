"""Rotary position embeddings: plain, Llama-3's and YaRN's long-context scalings, and partial
rotary (only the first ``rotary_dim`` of each head's dimensions turn), in HF's rotate-half
convention.

YaRN (Qwen3's long context, DeepSeek V2/V3, gpt-oss) blends each frequency between itself and
itself over ``factor`` by a linear ramp over the dimensions, and multiplies cos and sin by an
attention factor; that factor reaches q.k squared, so the architecture folds it into the query
scale (``ModelArch.scale``) where every dimension turns."""

from __future__ import annotations

import math
from typing import Any

import torch

from twophase.errors import ModelError

# rope_scaling types that need no change of the frequencies
PLAIN = {None, "default"}


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_scaling(scaling: dict[str, Any] | None, max_positions: int | None = None) -> dict[str, Any] | None:
    """The scaling the kit computes ('llama3' or 'yarn', with ``rope_type`` and the keys it
    reads), None for plain RoPE; any other is refused by name rather than ignored (a
    long-context model would run with the wrong frequencies). ``max_positions``: the config's
    ``max_position_embeddings``, YaRN's factor where the file gives none (DeepSeek's way)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in PLAIN:
        return None
    if kind == "yarn":
        return _yarn(scaling, max_positions)
    if kind != "llama3":
        raise ModelError(f"RoPE scaling {kind!r} is not implemented (the rotary kit computes "
                         f"plain RoPE, 'llama3' and 'yarn')")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ModelError(f"RoPE scaling 'llama3' needs {', '.join(missing)}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_KEYS}}


def _yarn(s: dict[str, Any], max_positions: int | None) -> dict[str, Any]:
    """YaRN's keys with transformers' defaults, and its attention factor computed."""
    old = s.get("original_max_position_embeddings") or max_positions
    if not old:
        raise ModelError("RoPE scaling 'yarn' needs original_max_position_embeddings")
    factor = s.get("factor") or (max_positions / old if max_positions else None)
    if not factor or factor <= 0:
        raise ModelError(f"RoPE scaling 'yarn' needs a factor above 0; got {s.get('factor')!r}")
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dims = s.get("mscale"), s.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims) if mscale and all_dims \
            else yarn_mscale(factor)
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(old),
            "beta_fast": float(s.get("beta_fast") or 32), "beta_slow": float(s.get("beta_slow") or 1),
            "truncate": bool(s.get("truncate", True)), "attention_factor": float(attention)}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (YaRN's), 1 for the others."""
    return scaling.get("attention_factor", 1.0) if scaling else 1.0


def inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """On the CPU always (a few floats), also inside a meta-device build, where arithmetic would
    run through torch's Python reference ops and import ``torch._dynamo`` (seconds)."""
    hd = rotary_dim
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    if not scaling:
        return inv
    if scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(hd, theta, scaling)
    # Llama-3: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """Each frequency blended from itself (extrapolated: the fast dimensions, past ``beta_fast``
    turns over the original context) to itself over ``factor`` (interpolated: the slow ones,
    under ``beta_slow`` turns), by a linear ramp between."""
    old = s["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:           # the dimension that turns ``turns`` times over ``old``
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    keep = 1 - ramp                              # the share extrapolated
    return 1.0 / (s["factor"] * pos) * (1 - keep) + 1.0 / pos * keep


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
