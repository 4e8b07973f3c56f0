"""Adapters applied unmerged, many in one batch (Punica's and S-LoRA's idea), in a few matrix
products a projection whatever the mix: each projection keeps every resident adapter's A
stacked (``[R, in]``, R their ranks summed) and, for each output range adapters reach (a fused
q/k/v projection has three), their B blocks side by side, scaled (``[rows, R_range]``). A
forward computes the base product, then ``x @ A_all^T`` (every token's shrink by every resident
adapter: R columns), zeroes the columns of adapters other than the token's own, and adds each
range's ``h[:, its columns] @ B_range^T`` into its rows of the output.

The first form of this (a loop over the adapters present, each on its tokens) cost 31% of decode
at batch 32 with four adapters interleaved (gathers and many small products); stacked, with one
B over the whole output (zeros outside each adapter's rows), 22%: at batch 32 decode reads
weights, and that B was two-thirds zeros for q/k/v and half for gate/up. By range, the bytes
read are the adapters' own. The work grows with the resident adapters' total rank
(``model.max_loras`` times their rank), not with how they are mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from twophase.lora.peft_adapter import LoraAdapter

ADAPTABLE = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


class LoraContext:
    """Which resident slot each token of the current forward uses (shared by every
    ``LoraLinear`` of a model); None: no token uses one."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def set(self, token_slots: Sequence[int], device: torch.device | str = "cpu") -> None:
        """``token_slots``: each token's slot, -1 for the base model."""
        self.token_slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        self._masks = {}

    def clear(self) -> None:
        self.token_slots = None
        self._masks = {}

    def mask(self, key: tuple[int, ...], cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[tokens, R]``: 1 where column ``j`` is the token's own adapter's. Projections of one
        kind stack their adapters alike (every layer's q, k, v), so one is made a forward for
        each and shared (``key``: the columns' slots)."""
        assert self.token_slots is not None
        m = self._masks.get(hash(key))
        if m is None:
            m = self._masks[hash(key)] = (cols[None, :] == self.token_slots[:, None]).to(dtype)
        return m


class LoraLinear(nn.Module):
    """A projection plus the deltas of the adapters resident in its slots."""

    def __init__(self, base: nn.Linear, ctx: LoraContext):
        super().__init__()
        self.base, self.ctx = base, ctx
        self.in_features, self.out_features = base.in_features, base.out_features
        # slot -> (row start, row stop, A [r, in], B [rows, r], scale) for each delta here
        self.slots: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
        self._stacked: tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, torch.Tensor]]] | None = None
        self._cols: tuple[int, ...] = ()

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def changed(self) -> None:
        """The slots changed: stack them again at the next forward."""
        self._stacked = None

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, torch.Tensor]]]:
        """A of every delta stacked ``[R, in]``, each column's slot ``[R]``, and for each output
        range the deltas reach (q, k and v of a fused projection are three), its B blocks scaled
        side by side: ``(row start, row stop, column start, column stop, B [rows, columns])``.
        Columns are ordered by output range, then slot, so each range's are contiguous."""
        if self._stacked is None:
            w = self.base.weight
            deltas = sorted(((d[0], d[1], slot, d) for slot, ds in self.slots.items() for d in ds),
                            key=lambda t: t[:3])
            a = torch.cat([d[2] for *_, d in deltas]).to(w.device, w.dtype)
            cols: list[int] = []
            groups: list[tuple[int, int, int, int, torch.Tensor]] = []
            for start, stop in dict.fromkeys((d[0], d[1]) for d in deltas):
                mine = [(slot, d) for s0, s1, slot, d in deltas if (s0, s1) == (start, stop)]
                b = torch.cat([(d[3] * d[4]).to(w.device, w.dtype) for _, d in mine], dim=1)
                groups.append((start, stop, len(cols), len(cols) + b.shape[1], b))
                cols += [slot for slot, d in mine for _ in range(d[2].shape[0])]
            self._stacked = (a, torch.tensor(cols, dtype=torch.long, device=w.device), groups)
            self._cols = tuple(cols)
        return self._stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        token_slots = self.ctx.token_slots
        if not self.slots or token_slots is None:
            return y
        a, cols, groups = self._stack()
        h = (x @ a.T).mul_(self.ctx.mask(self._cols, cols, x.dtype))
        for start, stop, c0, c1, b in groups:
            y[:, start:stop].addmm_(h[:, c0:c1], b.T)       # in place: the base product is ours
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
        if lin.slots.pop(slot, None) is not None:
            lin.changed()
    if adapter is None:
        return
    for d in adapter.deltas:
        lin = wrapped[(d.layer, d.module)]
        lin.slots.setdefault(slot, []).append(
            (d.rows[0], d.rows[1], d.a.to(device, dtype), d.b.to(device, dtype), d.scale))
        lin.changed()
