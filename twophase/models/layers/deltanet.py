"""A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) over core's state slots.

Each value head keeps a matrix ``S [k_head_dim, v_head_dim]`` in place of K/V. A token decays it
by ``exp(g)``, writes its value where its key points with strength ``beta`` (the delta rule:
``S += k (beta (v - S^T k))^T``), and reads ``o = S^T q``. Before that a causal depthwise
convolution of ``conv_kernel`` taps runs over q, k and v together. A sequence's cache is its
convolution's last ``conv_kernel - 1`` inputs and its matrices: a fixed size whatever its length,
in the state slot it holds (``KVCache.states``, the batch's ``state_slots``).

A decode runs the one-step recurrence; a prefill chunk the chunked form (``CHUNK`` tokens at a
time: the updates within a chunk solved as one triangular system, the state carried from chunk
to chunk and from one engine chunk to the next). Both are the same function of the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twophase.arch import DeltaNetSpec, ModelArch
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.state import StateMeta, conv_chunk, start_from

CHUNK = 64                  # tokens the chunked form solves at once


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, scaled by ``w`` (no offset) and gated by
    ``silu(z)``."""

    offset = 0.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArch, spec: DeltaNetSpec):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.spec = spec
        s = spec
        self.qk = s.num_k_heads * s.k_head_dim
        self.vd = s.num_v_heads * s.v_head_dim
        # q, k, v, z, b and a in one matmul (rows: qkv | z | b | a, or Qwen3-Next's qkvz | ba)
        self.in_proj = nn.Linear(hidden, 2 * self.qk + 2 * self.vd + 2 * s.num_v_heads, bias=False)
        self.conv = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False)   # weights only
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, eps)
        self.out_proj = nn.Linear(self.vd, hidden, bias=False)

    def split(self, proj: torch.Tensor):
        """``[T, rows]`` → qkv ``[T, conv_dim]``, z ``[T, Hv, dv]``, b and a ``[T, Hv]``."""
        s, T = self.spec, proj.shape[0]
        hv, dv = s.num_v_heads, s.v_head_dim
        if not s.interleaved:
            qkv, z, b, a = proj.split([2 * self.qk + self.vd, self.vd, hv, hv], dim=-1)
            return qkv, z.reshape(T, hv, dv), b, a
        r = hv // s.num_k_heads                        # value heads a key head
        qkvz, ba = proj.split([2 * self.qk + 2 * self.vd, 2 * hv], dim=-1)
        qkvz = qkvz.reshape(T, s.num_k_heads, 2 * s.k_head_dim + 2 * r * dv)
        q, k, v, z = qkvz.split([s.k_head_dim, s.k_head_dim, r * dv, r * dv], dim=-1)
        b, a = ba.reshape(T, s.num_k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, hv, dv), b.reshape(T, hv), a.reshape(T, hv)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMeta | GraphMeta) -> torch.Tensor:
        s = self.spec
        qkv, z, b, a = self.split(self.in_proj(x))
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if isinstance(meta, GraphMeta):                # traced: the decodes' states in and out
            rows = meta.dec_index
            o, new = self.step(qkv[rows], g[rows], beta[rows], state, meta.dec_cached == 0)
            meta.new_states.append(new)
            out = o.new_zeros(x.shape[0], s.num_v_heads, s.v_head_dim).index_copy(0, rows, o)
            return self.out_proj(self.norm(out.to(x.dtype), z).reshape(x.shape[0], self.vd))
        conv_state, rec_state = state
        out = torch.empty(x.shape[0], s.num_v_heads, s.v_head_dim, dtype=torch.float32, device=x.device)
        decodes = meta.decodes(x.device)
        if decodes is not None:                        # one step for all of them at once
            rows, slots, fresh = decodes
            o, (tail, S) = self.step(qkv[rows], g[rows], beta[rows], (conv_state[slots], rec_state[slots]), fresh)
            conv_state[slots] = tail.to(conv_state.dtype)
            rec_state[slots] = S.to(rec_state.dtype)
            out[rows] = o
        for first, n, start, slot in meta.chunks():
            mixed = F.silu(conv_chunk(qkv[first:first + n], conv_state, slot, start, self.conv.weight, None))
            q, k, v = self.heads(mixed)
            o, S = chunked(q, k, v, g[first:first + n], beta[first:first + n], start_from(rec_state[slot], start))
            rec_state[slot] = S.to(rec_state.dtype)
            out[first:first + n] = o
        o = self.norm(out.to(x.dtype), z)
        return self.out_proj(o.reshape(x.shape[0], self.vd))

    def step(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: tuple[torch.Tensor, ...],
             fresh: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One token of each of ``B`` sequences (``qkv [B, conv_dim]``, g and beta ``[B, Hv]``)
        from their states (``[B, *shape]`` each; a ``fresh [B]`` one starts from zeros) → o
        ``[B, Hv, dv]`` and the new states (float32)."""
        conv_state, rec_state = state
        tail = conv_state.float().masked_fill(fresh[:, None, None], 0.0)              # [B, C, K-1]
        window = torch.cat([tail, qkv.float().unsqueeze(-1)], dim=-1)                # [B, C, K]
        mixed = F.silu((window * self.conv.weight.float()[:, 0]).sum(-1))             # [B, C]
        q, k, v = self.heads(mixed)
        S = rec_state.float().masked_fill(fresh[:, None, None, None], 0.0)
        o, S = step(q, k, v, g, beta, S)
        return o, (window[..., 1:], S)

    def heads(self, mixed: torch.Tensor):
        """The convolution's output ``[T, C]`` as q, k ``[T, Hv, dk]`` (L2-normalised, q scaled
        by ``dk ** -0.5``, each key head repeated for its value heads) and v ``[T, Hv, dv]``."""
        s, T = self.spec, mixed.shape[0]
        q, k, v = mixed.split([self.qk, self.qk, self.vd], dim=-1)
        r = s.num_v_heads // s.num_k_heads
        q, k = (t.reshape(T, s.num_k_heads, s.k_head_dim).repeat_interleave(r, dim=1) for t in (q, k))
        q, k = l2norm(q) * s.k_head_dim ** -0.5, l2norm(k)
        return q, k, v.reshape(T, s.num_v_heads, s.v_head_dim)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def step(q, k, v, g, beta, S):
    """One token a sequence: q, k ``[B, H, dk]``, v ``[B, H, dv]``, g and beta ``[B, H]``,
    S ``[B, H, dk, dv]`` → o ``[B, H, dv]`` and the new S."""
    S = S * g.exp()[..., None, None]
    kv = (S * k[..., None]).sum(-2)                                   # S^T k: [B, H, dv]
    S = S + k[..., None] * ((v - kv) * beta[..., None])[..., None, :]
    return (S * q[..., None]).sum(-2), S


def chunked(q, k, v, g, beta, S):
    """``n`` tokens of one sequence (q, k ``[n, H, dk]``, v ``[n, H, dv]``, g, beta ``[n, H]``)
    from state ``S [H, dk, dv]``, ``CHUNK`` at a time → o ``[n, H, dv]`` and the final S.

    Within a chunk, with ``c_t`` the cumulative log-decay, the values each token writes,
    ``u_t = beta_t (v_t - e^{c_t} S0^T k_t - sum_{i<t} e^{c_t - c_i} (k_t . k_i) u_i)``, are one
    unit lower-triangular system; then ``o_t = e^{c_t} S0^T q_t + sum_{i<=t} e^{c_t - c_i}
    (q_t . k_i) u_i`` and ``S = e^{c_L} S0 + sum_i e^{c_L - c_i} k_i u_i^T``."""
    outs = []
    for at in range(0, q.shape[0], CHUNK):
        qc, kc, vc = (t[at:at + CHUNK].transpose(0, 1) for t in (q, k, v))    # [H, L, d]
        gc, bc = (t[at:at + CHUNK].T for t in (g, beta))                      # [H, L]
        L = qc.shape[1]
        c = gc.cumsum(-1)
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~lower, float("-inf")).exp()   # [H, L, L]
        strict = (kc @ kc.transpose(-1, -2)) * decay * bc[:, :, None]
        system = strict.masked_fill(lower.logical_not() | torch.eye(L, dtype=torch.bool, device=q.device), 0.0)
        system = system + torch.eye(L, dtype=system.dtype, device=q.device)
        rhs = bc[..., None] * (vc - (c.exp()[..., None] * kc) @ S)          # [H, L, dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        o = (c.exp()[..., None] * qc) @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        S = c[:, -1:].exp()[..., None] * S + (kc * (c[:, -1:] - c).exp()[..., None]).transpose(-1, -2) @ u
        outs.append(o.transpose(0, 1))
    return torch.cat(outs), S
