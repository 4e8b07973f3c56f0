"""A mixture-of-experts MLP: a router picks ``top_k`` experts a token (softmax over all
experts, then the top k, renormalised or not), an optional shared expert runs for every token
(its output gated by ``sigmoid`` of a gate of its own, or added as it is). gpt-oss adds biases
to the router and every expert (``bias``); its softmax over the top k logits is the
renormalised top k of the softmax over all.

Experts' weights are stacked (``[E, 2f, h]`` and ``[E, h, f]``), so a GGUF's ``*_exps`` tensors
map onto them as stored. Eagerly each expert reads its weights once for all the tokens routed to
it, and experts no token chose are not read at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from twophase.arch import MLPSpec
from twophase.models.layers.mlp import SWIGLU, GatedMLP, Glu
from twophase.models.layers.moe_graph import FORMS


class Experts(nn.Module):
    """``weight [E, out, in]``: every expert's matrix, stacked (``bias [E, out]`` where the
    family has them)."""

    def __init__(self, experts: int, out: int, inp: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inp))
        self.bias = nn.Parameter(torch.empty(experts, out)) if bias else None

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s matrix on rows ``x``."""
        y = x @ self.weight[e].T
        return y if self.bias is None else y + self.bias[e]


class MoE(nn.Module):
    def __init__(self, hidden: int, spec: MLPSpec, glu: Glu = SWIGLU, bias: bool = False):
        super().__init__()
        E, f = spec.num_experts, spec.intermediate_size
        self.top_k, self.norm_topk, self.f, self.glu = spec.top_k, spec.norm_topk_prob, f, glu
        self.spec = spec
        self.router = nn.Linear(hidden, E, bias=bias)
        if spec.score_bias:                     # DeepSeek V3's: added to choose, not to weigh
            self.score_bias = nn.Parameter(torch.zeros(E))
        self.experts_gate_up = Experts(E, 2 * f, hidden, bias)
        self.experts_down = Experts(E, hidden, f, bias)
        self.shared: GatedMLP | None = None
        self.shared_gated = spec.shared_gated
        self.graph_form: str | None = None     # set while an exporter traces (``traced_as``)
        if spec.shared_intermediate_size:
            self.shared = GatedMLP(hidden, spec.shared_intermediate_size, glu=glu)
            if spec.shared_gated:
                self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x) if self.graph_form is None else FORMS[self.graph_form](self, x)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.shared_gated else shared)
        return out

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts and their weights, as ``spec`` routes: scores (softmax
        or sigmoid), a bias for choosing, only the best groups' experts, the chosen scores
        renormalised where asked and scaled."""
        spec = self.spec
        scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)
        pick = scores + self.score_bias.float() if spec.score_bias else scores
        if spec.groups > 1:
            grouped = pick.view(pick.shape[0], spec.groups, -1)
            best = grouped.amax(-1) if spec.group_score == "max" else grouped.topk(2, dim=-1).values.sum(-1)
            kept = torch.zeros_like(best).scatter_(1, best.topk(spec.topk_groups, dim=-1).indices, 1.0)
            pick = pick.masked_fill(kept.repeat_interleave(grouped.shape[-1], dim=1) == 0, float("-inf"))
        experts = pick.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
        return weights * spec.routed_scale, experts

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Eagerly: each expert reads its weights once for the tokens routed to it."""
        weights, experts = self.choose(self.router(x).float())       # [T, k]
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            h = self.glu(self.experts_gate_up.matmul(e, x[rows]), self.f)
            out.index_add_(0, rows, self.experts_down.matmul(e, h) * weights[rows, slot, None].to(x.dtype))
        return out


@contextmanager
def traced_as(model: nn.Module, form: str) -> Iterator[None]:
    """Every MoE in ``model`` computes in the static ``form`` (``moe_graph.FORMS``) while an
    exporter traces it."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.graph_form = form
    try:
        yield
    finally:
        for m in moes:
            m.graph_form = None
