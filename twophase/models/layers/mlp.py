"""The gated MLP (SwiGLU, or Gemma's tanh-GELU gate), gate and up in one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, width: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.f, self.act = width, act
        self.gate_up = nn.Linear(hidden, 2 * width, bias=bias)   # one weight read for both
        self.down = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate, up = gate_up[:, :self.f], gate_up[:, self.f:]
        return self.down(activation(self.act, gate) * up)
