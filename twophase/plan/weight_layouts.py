"""The bytes a backend holds for a model's weights, per tensor group, from shapes alone.

Three layouts: ``dense`` (every matrix in the model's dtype: torch, IREE, TensorRT), ``blocks``
(the native backend: the GGUF's 4-bit blocks of 32 as they are, 20 bytes, a zero-point byte a
block, the head at 8 bits as Q8_0's 34 bytes a block, the outlier input channels' columns in
float32, the embedding in float32) and ``matmulnbits`` (ONNX Runtime's ``MatMulNBits`` inputs:
packed codes, float32 scales, packed zero points, and the float32 term for each block's minimum
and the outlier channels; see ``twophase.exporters.q4``). Counted as those files lay them out, so
the figures are exact to the byte for the tensors and leave out only runtime bookkeeping.
"""

from __future__ import annotations

from twophase.arch import ModelArch
from twophase.models import param_counts

BLOCK = 32
GROUPS = param_counts.GROUPS


def projections(arch: ModelArch) -> dict[str, list[tuple[int, int]]]:
    """Each group's matrices as (out, in) shapes, for all layers (from the model itself)."""
    return param_counts.matrices(arch)


def _biases(arch: ModelArch) -> dict[str, int]:
    return param_counts.biases(arch)


def dense(arch: ModelArch, itemsize: int) -> dict[str, int]:
    """Every tensor in one dtype; a tied head shares the embedding's bytes."""
    return {g: n * itemsize for g, n in param_counts.group_params(arch).items()}


def _outliers(k: int, count: int) -> int:
    return min(count, k // 2) if count > 0 else 0


def blocks(arch: ModelArch, outlier_channels: int, head_bits: int = 8) -> dict[str, int]:
    """The native backend's files: 20-byte Q4_1 blocks and a zero-point byte each, float32
    outlier columns and their int32 indices, Q8_0 head (34 bytes a block), float32 rest."""
    out = {}
    for g, mats in projections(arch).items():
        total = 0
        for n, k in mats:
            c = _outliers(k, outlier_channels)
            total += n * (k // BLOCK) * 21 + n * c * 4 + c * 4
        out[g] = total + _biases(arch)[g] * 4
    V, h = arch.vocab_size, arch.hidden_size
    head = V * (h // BLOCK) * (34 if head_bits == 8 else 21)
    return {"embedding": V * h * 4, **out, "norms": param_counts.group_params(arch)["norms"] * 4, "head": head}


def matmulnbits(arch: ModelArch, outlier_channels: int, head_bits: int = 8) -> dict[str, int]:
    """ONNX Runtime's q4 graph: per projection ``N*K/2`` code bytes, ``N*K/32`` float32 scales,
    ``N*ceil(K/64)`` zero-point bytes, the ``[K/32 + c, N]`` float32 term (minimums and outlier
    columns), the ``K`` float32 keep mask and ``c`` int64 indices; the head's 8-bit codes and
    zero points without a term; float32 embedding and norms."""
    out = {}
    for g, mats in projections(arch).items():
        total = 0
        for n, k in mats:
            nb, c = k // BLOCK, _outliers(k, outlier_channels)
            total += n * k // 2 + n * nb * 4 + n * -(-nb // 2) + (nb + c) * n * 4
            total += 24                                              # reshape shape and axis
            total += (k * 4 + c * 8) if c else 0
        out[g] = total + _biases(arch)[g] * 4
    V, h = arch.vocab_size, arch.hidden_size
    nb = h // BLOCK
    if head_bits == 8:
        head = V * h + V * nb * 4 + V * nb
    else:
        head = V * h // 2 + V * nb * 4 + V * -(-nb // 2) + nb * V * 4 + 24
    return {"embedding": V * h * 4, **out, "norms": param_counts.group_params(arch)["norms"] * 4, "head": head}
