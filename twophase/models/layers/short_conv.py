"""A gated short convolution (LFM2) over core's state slots.

``in_proj`` gives three gates a channel, B, C and x; a causal depthwise convolution of
``conv_kernel`` taps runs over ``B * x``; C gates its output and ``out_proj`` maps it back. A
sequence's cache is the convolution's last ``conv_kernel - 1`` inputs: a fixed size whatever its
length, in the state slot it holds (``KVCache.states``, the batch's ``state_slots``).

Decodes (one token each) run together as one window a sequence; a prefill chunk convolves its
tokens after the tail the chunk before it left (zeros at position 0).
"""

from __future__ import annotations

import torch
from torch import nn

from twophase.arch import ModelArch, ShortConvSpec
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.state import StateMeta, conv_chunk


class ShortConv(nn.Module):
    def __init__(self, arch: ModelArch, spec: ShortConvSpec):
        super().__init__()
        c = spec.channels
        self.spec = spec
        self.in_proj = nn.Linear(arch.hidden_size, 3 * c, bias=spec.bias)
        self.conv = nn.Conv1d(c, c, spec.conv_kernel, groups=c, bias=spec.bias)   # weights [c, 1, K]
        self.out_proj = nn.Linear(c, arch.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMeta | GraphMeta) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = (b * v).float()                                                       # [T, C]
        if isinstance(meta, GraphMeta):                # traced: the decodes' states in and out
            rows = meta.dec_index
            y, new = self.step(bx[rows], state, meta.dec_cached == 0)
            meta.new_states.append(new)
            return self.out_proj(c * torch.zeros_like(bx).index_copy(0, rows, y).to(x.dtype))
        (conv_state,) = state
        out = torch.empty_like(bx)
        decodes = meta.decodes(x.device)
        if decodes is not None:                        # one window a sequence, all at once
            rows, slots, fresh = decodes
            out[rows], (tail,) = self.step(bx[rows], (conv_state[slots],), fresh)
            conv_state[slots] = tail.to(conv_state.dtype)
        for first, n, start, slot in meta.chunks():
            out[first:first + n] = conv_chunk(bx[first:first + n], conv_state, slot, start, self.conv.weight,
                                              self.conv.bias)
        return self.out_proj(c * out.to(x.dtype))

    def step(self, bx: torch.Tensor, state: tuple[torch.Tensor, ...],
             fresh: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        """One token of each of ``B`` sequences (``bx [B, C]``) after their tails (``[B, C,
        K-1]``; a ``fresh [B]`` one's are zeros) → the convolution's output ``[B, C]`` and the
        new tails (float32)."""
        tail = state[0].float().masked_fill(fresh[:, None, None], 0.0)                # [B, C, K-1]
        window = torch.cat([tail, bx.unsqueeze(-1)], dim=-1)                          # [B, C, K]
        y = (window * self.conv.weight.float()[:, 0]).sum(-1)
        return (y if self.conv.bias is None else y + self.conv.bias.float()), (window[..., 1:],)
