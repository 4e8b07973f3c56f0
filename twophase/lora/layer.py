"""Adapters applied unmerged, many in one batch (Punica's and S-LoRA's idea): each adapted
projection computes the base product for every token once, then, for each adapter present in
the batch, ``scale * (x[rows] @ A.T) @ B.T`` on that adapter's tokens only (a shrink to the rank,
then an expand), added to the output rows the adapter's module owns.

The rows of a batch that share an adapter are found once a forward (``LoraContext.set``), not
once a projection. A projection with no adapter resident costs one dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from twophase.lora.peft_adapter import LoraAdapter

ADAPTABLE = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


class LoraContext:
    """Which tokens of the current forward use which resident slot (shared by every
    ``LoraLinear`` of a model)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []

    def set(self, token_slots: Sequence[int]) -> None:
        """``token_slots``: each token's slot, -1 for the base model. A sequence's tokens are
        consecutive, so each slot's tokens are usually one run (a slice, no gather)."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for i in range(1, len(token_slots) + 1):
            if i == len(token_slots) or token_slots[i] != token_slots[start]:
                if token_slots[start] >= 0:
                    runs.setdefault(token_slots[start], []).append((start, i))
                start = i
        self.groups = [(slot, slice(*r[0]) if len(r) == 1 else
                        torch.cat([torch.arange(a, b) for a, b in r])) for slot, r in runs.items()]

    def clear(self) -> None:
        self.groups = []


class LoraLinear(nn.Module):
    """A projection plus the deltas of the adapters resident in its slots."""

    def __init__(self, base: nn.Linear, ctx: LoraContext):
        super().__init__()
        self.base, self.ctx = base, ctx
        self.in_features, self.out_features = base.in_features, base.out_features
        # slot -> (row start, row stop, A [r, in], B [rows, r], scale) for each delta here
        self.slots: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.slots:
            return y
        for slot, rows in self.ctx.groups:
            for start, stop, a, b, scale in self.slots.get(slot, ()):
                xs = x[rows]
                y[rows, start:stop] += ((xs @ a.to(xs.dtype).T) @ b.to(xs.dtype).T) * scale
        return y


def attach(model: Any) -> tuple[LoraContext, dict[tuple[int, str], LoraLinear]]:
    """Wrap every dense projection an adapter may reach (``ADAPTABLE``, where a layer has it as
    an ``nn.Linear``) once, at load; adapters then come and go by slot."""
    ctx = LoraContext()
    wrapped: dict[tuple[int, str], LoraLinear] = {}
    for i, block in enumerate(model.layers):
        for name in ADAPTABLE:
            parent_name, _, attr = name.rpartition(".")
            parent = getattr(block, parent_name, None)
            base = getattr(parent, attr, None) if parent is not None else None
            if isinstance(base, nn.Linear):
                wrapped[(i, name)] = LoraLinear(base, ctx)
                setattr(parent, attr, wrapped[(i, name)])
    return ctx, wrapped


def place(wrapped: dict[tuple[int, str], LoraLinear], slot: int, adapter: LoraAdapter | None,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Put ``adapter``'s deltas in ``slot`` of every projection they reach (None: empty it)."""
    for lin in wrapped.values():
        lin.slots.pop(slot, None)
    if adapter is None:
        return
    for d in adapter.deltas:
        lin = wrapped[(d.layer, d.module)]
        lin.slots.setdefault(slot, []).append(
            (d.rows[0], d.rows[1], d.a.to(device, dtype), d.b.to(device, dtype), d.scale))
