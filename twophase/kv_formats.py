"""How the K/V pool stores one head's vector of ``head_dim`` values: ``[cache] dtype``.

The float formats store the values as they are, in that dtype. ``int8`` stores llama.cpp's q8_0
layout for K/V: each run of 32 values along the head dimension as 32 signed codes and one
float16 scale (``amax / 127``, round to nearest), the scales kept after the codes in the same
row, so a pool row is ``head_dim + head_dim / 16`` bytes (a head of 64 values: 68 bytes against
128 in float16). ``fp8`` stores each value as float8 e4m3 (vLLM's ``fp8`` K/V with its default
scale of 1), saturated at +-448 where e4m3 would give NaN; GPUs since Hopper convert it in
hardware. Every reader of the pool sees rows through ``encode``/``decode``; which formats a
backend reads is ``Capabilities.kv_formats``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KV_FORMATS", "KVFormat", "kv_format", "kv_format_of"]

RUN = 32              # values a scale: a run (q8_0's block)


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype          # the pool's element type
    quantized: bool = False
    saturate: bool = False        # clamp to the storage type's range (float8: beyond it is NaN)

    def row(self, head_dim: int) -> int:
        """Elements of the pool's last dimension for one head's ``head_dim`` values."""
        return head_dim + 2 * (head_dim // RUN) if self.quantized else head_dim

    def head_dim(self, row: int) -> int:
        """The head dimension a pool row of ``row`` elements holds."""
        return row * RUN // (RUN + 2) if self.quantized else row

    def bytes_per_value(self, head_dim: int) -> float:
        return self.row(head_dim) * torch.empty((), dtype=self.storage).element_size() / head_dim

    def check(self, head_dim: int) -> None:
        if self.quantized and head_dim % RUN:
            raise ValueError(f"cache.dtype {self.name!r} stores K/V in runs of {RUN} values; "
                             f"this model's head_dim is {head_dim}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., head_dim]`` as pool rows ``[..., row]``."""
        if self.saturate:
            top = torch.finfo(self.storage).max
            return x.float().clamp(-top, top).to(self.storage)
        if not self.quantized:
            return x.to(self.storage)
        hd = x.shape[-1]
        runs = x.float().reshape(*x.shape[:-1], hd // RUN, RUN)
        d = runs.abs().amax(-1, keepdim=True) / 127          # as ggml's quantize_row_q8_0_ref:
        scaled = runs * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))   # codes from the float32
        a = scaled.abs()                                     # scale, rounded half away from zero
        codes = (scaled.sign() * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
        codes = codes.reshape(*x.shape[:-1], hd)
        scales = d.to(torch.float16).reshape(*x.shape[:-1], hd // RUN).contiguous().view(torch.int8)
        return torch.cat([codes, scales], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pool rows ``[..., row]`` as values ``[..., head_dim]`` in ``dtype``."""
        if not self.quantized:
            return rows.to(dtype)
        hd = self.head_dim(rows.shape[-1])
        codes = rows[..., :hd].reshape(*rows.shape[:-1], hd // RUN, RUN)
        scales = rows[..., hd:].contiguous().view(torch.float16).unsqueeze(-1)
        return (codes.to(dtype) * scales.to(dtype)).reshape(*rows.shape[:-1], hd)


KV_FORMATS = {f.name: f for f in (KVFormat("float32", torch.float32), KVFormat("float16", torch.float16),
                                  KVFormat("bfloat16", torch.bfloat16),
                                  KVFormat("int8", torch.int8, quantized=True),
                                  KVFormat("fp8", torch.float8_e4m3fn, saturate=True))}


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"cache.dtype {name!r} is not a K/V format; one of {', '.join(KV_FORMATS)}") from None


def kv_format_of(dtype: torch.dtype) -> KVFormat:
    """The format a pool of element type ``dtype`` stores (each format has its own)."""
    return next(f for f in KV_FORMATS.values() if f.storage == dtype)
