"""What every state layer shares: the step's view of the state slots.

A state layer's module (one a kind of ``twophase.arch.StateLayerSpec``, listed in
``models/decoder.py: STATE_LAYERS``) takes ``(arch, spec)``; its forward takes the normed hidden
states ``[T, hidden]``, its state tensors (``KVCache.states[j]``, one row a slot) and a
``StateMeta``, reads and updates each sequence's row (a span at position 0 starts from zeros)
and returns ``[T, hidden]``.

In a traced step graph (``GraphMeta``) the module is given, in place of the slots' tensors, the
decodes' states gathered at their slots (``[D, *shape]``, by the backend) and computes only
those one-token sequences: its ``step``, the function the eager decodes run too, appending the
new states to ``GraphMeta.new_states`` for the backend to write back at the slots.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StateMeta:
    """Which state slot each sequence of a step holds and which of its tokens it computes."""

    slots: list[int]                       # [B] each sequence's slot
    spans: list[tuple[int, int, int]]      # [B] (first token index, tokens, tokens before them)

    def decodes(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The one-token sequences, for one batched ``step``: their token rows, their slots and
        which start from zeros (at position 0); None where there are none."""
        idx = [i for i, (_, n, _) in enumerate(self.spans) if n == 1]
        if not idx:
            return None
        return (torch.tensor([self.spans[i][0] for i in idx], device=device),
                torch.tensor([self.slots[i] for i in idx], device=device),
                torch.tensor([self.spans[i][2] == 0 for i in idx], device=device))

    def chunks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(first token index, tokens, tokens before them, slot)`` of each longer chunk."""
        for (first, n, start), slot in zip(self.spans, self.slots):
            if n > 1:
                yield first, n, start, slot


def start_from(row: torch.Tensor, start: int) -> torch.Tensor:
    """A slot's state as a chunk at ``start`` begins from it: the row in float32, or zeros at
    position 0 (the row then holds an earlier sequence's state)."""
    return row.float() if start else torch.zeros_like(row, dtype=torch.float)


def conv_chunk(x: torch.Tensor, tails: torch.Tensor, slot: int, start: int, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """A causal depthwise convolution over one sequence's chunk ``x [n, C]`` after the inputs
    its slot keeps (``tails [slots, C, K - 1]``), which it replaces with the chunk's last ones;
    ``weight [C, 1, K]``. Returns ``[n, C]`` (float32, no activation)."""
    seq = torch.cat([start_from(tails[slot], start), x.float().T], dim=-1)          # [C, K-1+n]
    tails[slot] = seq[:, x.shape[0]:].to(tails.dtype)
    return F.conv1d(seq.unsqueeze(0), weight.float(), None if bias is None else bias.float(),
                    groups=seq.shape[0])[0].T
