"""The gated MLP (SwiGLU, Gemma's tanh-GELU gate, gpt-oss's clamped SwiGLU), gate and up in
one matrix."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twophase.arch import ModelArch


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Glu:
    """How gate and up (side by side, ``f`` columns each) make the MLP's hidden: ``act(gate) *
    up``, or gpt-oss's clamped form, ``g * sigmoid(alpha * g) * (u + 1)`` with the gate clamped
    above at ``limit`` and up to ``[-limit, limit]``."""

    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, arch: ModelArch) -> Glu:
        return cls(arch.activation, arch.swiglu_alpha, arch.swiglu_limit)

    def __call__(self, gate_up: torch.Tensor, f: int) -> torch.Tensor:
        gate, up = gate_up[:, :f], gate_up[:, f:]
        if self.act == "clamped_swiglu":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return gate * torch.sigmoid(self.alpha * gate) * (up + 1)
        return activation(self.act, gate) * up


SWIGLU = Glu()


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, width: int, bias: bool = False, glu: Glu = SWIGLU):
        super().__init__()
        self.f, self.glu = width, glu
        self.gate_up = nn.Linear(hidden, 2 * width, bias=bias)   # one weight read for both
        self.down = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.glu(self.gate_up(x), self.f))
