"""Weight formats as values: each block layout's values a block, bytes a block and GGUF tensor
type, so a tensor's bytes come from its format and a backend names the formats it runs.

``[model] quantization`` chooses how the engine holds the weights: ``"none"`` (the model's
dtype) or ``"q4"`` (4-bit blocks of 32 with a minimum, ``Q4_1``, and the head in ``Q8_0``). A
GGUF tensor stored in another format is converted to those only because ``"q4"`` asks for
them, and the loader says which tensors it converted; nothing is re-quantised silently.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str               # ggml's name: "Q4_1", "Q6_K", "F32", ...
    ggml_type: int | None   # the GGUF tensor type id (None: not a GGUF type)
    block: int              # values a block
    block_bytes: int        # bytes a block, scales included

    @property
    def bits(self) -> float:
        """Bits a value, scales and minimums included."""
        return 8 * self.block_bytes / self.block

    def bytes_for(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of ``shape`` (rows of ``shape[-1]`` values, whole blocks)."""
        n = 1
        for d in shape:
            n *= d
        if shape and shape[-1] % self.block:
            raise ValueError(f"{self.name}: rows of {shape[-1]} are not whole blocks of {self.block}")
        return n // self.block * self.block_bytes


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("F32", 0, 1, 4),
    WeightFormat("F16", 1, 1, 2),
    WeightFormat("BF16", 30, 1, 2),
    WeightFormat("Q4_0", 2, 32, 18),
    WeightFormat("Q4_1", 3, 32, 20),
    WeightFormat("Q5_0", 6, 32, 22),
    WeightFormat("Q5_1", 7, 32, 24),
    WeightFormat("Q8_0", 8, 32, 34),
    WeightFormat("Q2_K", 10, 256, 84),
    WeightFormat("Q3_K", 11, 256, 110),
    WeightFormat("Q4_K", 12, 256, 144),
    WeightFormat("Q5_K", 13, 256, 176),
    WeightFormat("Q6_K", 14, 256, 210),
    WeightFormat("MXFP4", 39, 32, 17),   # gpt-oss's: FP4 (E2M1) codes under an E8M0 scale a block
)}


def by_ggml_type(ggml_type: int) -> WeightFormat | None:
    """The format of a GGUF tensor type, None for one this table does not know."""
    return next((f for f in FORMATS.values() if f.ggml_type == int(ggml_type)), None)

