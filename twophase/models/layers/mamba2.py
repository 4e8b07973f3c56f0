"""A Mamba-2 (SSD) layer (Granite 4) over core's state slots.

One projection gives the gate ``z``, the convolution's input (x, B and C side by side) and ``dt``
a head. A causal depthwise convolution of ``conv_kernel`` taps (and SiLU) runs over x, B and C;
then each head keeps a matrix ``S [head_dim, state_size]``: a token decays it by ``exp(dt A)``,
adds ``dt x B^T`` and reads ``y = S C + D x`` (B and C in ``n_groups`` groups, each shared by
``num_heads / n_groups`` heads). The output is gated by ``silu(z)``, RMS-normed in ``n_groups``
groups and projected back. A sequence's cache is its convolution's last ``conv_kernel - 1``
inputs and its matrices: a fixed size whatever its length, in the state slot it holds.

A decode runs the one-step recurrence; a prefill chunk the chunked scan (``chunk_size`` tokens at
a time: within a chunk a masked, decayed ``C B^T`` product, the state carried from chunk to chunk
and from one engine chunk to the next). Both are the same function of the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twophase.arch import Mamba2Spec, ModelArch
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.state import StateMeta, conv_chunk, start_from


class GroupedGatedRMSNorm(nn.Module):
    """``x * silu(z)``, RMS-normed over each of ``groups`` equal parts, scaled by ``w``."""

    offset = 0.0

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        T, dim = x.shape
        h = (x.float() * F.silu(z.float())).view(T, self.groups, dim // self.groups)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(T, dim).to(x.dtype)


class Mamba2(nn.Module):
    def __init__(self, arch: ModelArch, spec: Mamba2Spec):
        super().__init__()
        s = self.spec = spec
        self.in_proj = nn.Linear(arch.hidden_size, s.inner + s.conv_dim + s.num_heads, bias=s.proj_bias)
        self.conv = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = GroupedGatedRMSNorm(s.inner, s.n_groups, arch.rms_norm_eps)
        self.out_proj = nn.Linear(s.inner, arch.hidden_size, bias=s.proj_bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMeta | GraphMeta) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        z, xbc, dt = self.in_proj(x).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())                  # [T, H]
        if isinstance(meta, GraphMeta):                # traced: the decodes' states in and out
            rows = meta.dec_index
            y, new = self.step(xbc[rows], dt[rows], state, meta.dec_cached == 0)
            meta.new_states.append(new)
            out = y.new_zeros(T, s.num_heads, s.head_dim).index_copy(0, rows, y)
            return self.out_proj(self.norm(out.view(T, s.inner).to(x.dtype), z))
        A = -self.A_log.float().exp()                                        # [H]
        conv_state, ssm_state = state
        out = torch.empty(T, s.num_heads, s.head_dim, dtype=torch.float32, device=x.device)
        decodes = meta.decodes(x.device)
        if decodes is not None:                        # one step for all of them at once
            rows, slots, fresh = decodes
            out[rows], (tail, S) = self.step(xbc[rows], dt[rows], (conv_state[slots], ssm_state[slots]), fresh)
            conv_state[slots] = tail.to(conv_state.dtype)
            ssm_state[slots] = S.to(ssm_state.dtype)
        for first, n, start, slot in meta.chunks():
            mixed = conv_chunk(xbc[first:first + n], conv_state, slot, start, self.conv.weight, self.conv.bias)
            xs, B, C = self.heads(F.silu(mixed))
            y, S = chunked(xs, dt[first:first + n], A, B, C, start_from(ssm_state[slot], start), s.chunk_size)
            ssm_state[slot] = S.to(ssm_state.dtype)
            out[first:first + n] = y + self.D.float()[:, None] * xs
        y = self.norm(out.view(T, s.inner).to(x.dtype), z)
        return self.out_proj(y)

    def step(self, xbc: torch.Tensor, dt: torch.Tensor, state: tuple[torch.Tensor, ...],
             fresh: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One token of each of ``B`` sequences (``xbc [B, conv_dim]``, ``dt [B, H]``) from
        their states (``[B, *shape]`` each; a ``fresh [B]`` one starts from zeros) → y ``[B, H,
        head_dim]`` (with ``D x``) and the new states (float32)."""
        conv_state, ssm_state = state
        A = -self.A_log.float().exp()                                        # [H]
        tail = conv_state.float().masked_fill(fresh[:, None, None], 0.0)    # [B, C, K-1]
        window = torch.cat([tail, xbc.float().unsqueeze(-1)], dim=-1)       # [B, C, K]
        mixed = (window * self.conv.weight.float()[:, 0]).sum(-1)
        xs, B, C = self.heads(F.silu(mixed if self.conv.bias is None else mixed + self.conv.bias.float()))
        S = ssm_state.float().masked_fill(fresh[:, None, None, None], 0.0)
        S = S * (dt * A).exp()[..., None, None] + (dt[..., None] * xs)[..., None] * B[:, :, None, :]
        return (S * C[:, :, None, :]).sum(-1) + self.D.float()[:, None] * xs, (window[..., 1:], S)

    def heads(self, mixed: torch.Tensor):
        """The convolution's output ``[T, C]`` as x ``[T, H, head_dim]`` and B, C ``[T, H,
        state_size]`` (each group's repeated for its heads)."""
        s, T = self.spec, mixed.shape[0]
        gn = s.n_groups * s.state_size
        xs, B, C = mixed.split([s.inner, gn, gn], dim=-1)
        r = s.num_heads // s.n_groups
        B, C = (t.reshape(T, s.n_groups, s.state_size).repeat_interleave(r, dim=1) for t in (B, C))
        return xs.reshape(T, s.num_heads, s.head_dim), B, C


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., L]`` → ``[..., L, L]``: ``sum_{j < k <= i} a_k`` at ``[i, j]`` for ``i >= j``,
    ``-inf`` above the diagonal: a cumulative sum of masked copies, as the reference takes it,
    rather than a difference of two cumulative sums."""
    L = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, L)                          # [..., k, j] = a_k
    lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    x = x.masked_fill(~lower.tril(-1), 0.0).cumsum(-2)               # keep k > j, sum over k <= i
    return x.masked_fill(~lower, float("-inf"))


def chunked(x, dt, A, B, C, S, chunk: int):
    """``n`` tokens of one sequence (x ``[n, H, P]``, dt ``[n, H]``, B, C ``[n, H, N]``) from
    state ``S [H, P, N]``, ``chunk`` at a time → y ``[n, H, P]`` (without ``D x``) and the final S.

    Within a chunk, with ``c_t`` the cumulative ``dt A``: ``y_t = e^{c_t} S0 C_t + sum_{s<=t}
    e^{c_t - c_s} (C_t . B_s) dt_s x_s`` and ``S = e^{c_L} S0 + sum_s e^{c_L - c_s} dt_s x_s B_s^T``."""
    outs = []
    for at in range(0, x.shape[0], chunk):
        xc = (x[at:at + chunk] * dt[at:at + chunk, :, None]).transpose(0, 1)      # [H, L, P]: dt x
        Bc, Cc = (t[at:at + chunk].transpose(0, 1) for t in (B, C))              # [H, L, N]
        a = (dt[at:at + chunk] * A).T                                              # [H, L]
        c = a.cumsum(-1)
        y = ((Cc @ Bc.transpose(-1, -2)) * segsum(a).exp()) @ xc + c.exp()[..., None] * (Cc @ S.transpose(-1, -2))
        S = c[:, -1:].exp()[..., None] * S + (xc * (c[:, -1:] - c).exp()[..., None]).transpose(-1, -2) @ Bc
        outs.append(y.transpose(0, 1))
    return torch.cat(outs), S
