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

from dataclasses import dataclass


@dataclass
class StateMeta:
    """Which state slot each sequence of a step holds and which of its tokens it computes."""

    slots: list[int]                       # [B] each sequence's slot
    spans: list[tuple[int, int, int]]      # [B] (first token index, tokens, tokens before them)
