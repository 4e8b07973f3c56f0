"""The mixture-of-experts MLP as a static graph: what the exporters trace in place of the eager
loop over the experts tokens chose (its ``.tolist()`` is data a graph cannot branch on).

Three forms, each the eager loop's numbers:

- ``op``: one call of ``twophase::moe``, which the ONNX exporter writes as ONNX Runtime's fused
  ``com.microsoft::MoE`` (softmax routing, top k, each expert on its own tokens: the eager
  loop's weight reads and FLOPs, in one kernel). Its gate and up are interleaved row by row,
  the layout that operator's CPU kernel reads.
- ``dense``: every expert on every token, weighted by a ``[T, E]`` matrix that is zero off each
  token's top k: every weight read once, ``E / k`` times the FLOPs (IREE's prefill).
- ``gathered``: each token's k experts' matrices gathered and applied: ``T * k`` expert reads
  and no FLOP wasted, right for a decode batch (IREE's decode), ruinous for a long prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from twophase.errors import ModelError


def route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top k experts and their weights: softmax over all, the top k, renormalised
    where ``norm`` (the plain routing, and what ONNX Runtime's fused operator computes)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = _top(probs, top_k)
    return (weights / weights.sum(-1, keepdim=True) if norm else weights), experts


def _top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row and where they are, one maximum at a time, not by
    ``topk``: IREE 3.x gave a second layer's ``topk`` the first one's indices. Of scores that
    tie exactly it takes the lowest-numbered expert, where the eager ``topk`` may take another:
    the two forms can route a tied token apart (float32 scores of real inputs rarely tie)."""
    picked = []
    for _ in range(k):
        picked.append(scores.max(dim=-1))
        scores = scores.masked_fill(torch.nn.functional.one_hot(picked[-1].indices, scores.shape[-1]).bool(),
                                    torch.finfo(scores.dtype).min)
    return torch.stack([p.values for p in picked], dim=-1), torch.stack([p.indices for p in picked], dim=-1)


def choose(moe: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoE.choose`` in static ops: scores (softmax or sigmoid), a choosing bias, only the
    best groups' experts, the chosen scores renormalised where asked and scaled."""
    spec = moe.spec
    if spec.routing_is_plain:
        return route(logits, moe.top_k, moe.norm_topk)
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)
    pick = scores + moe.score_bias.float() if spec.score_bias else scores
    if spec.groups > 1:
        grouped = pick.reshape(pick.shape[0], spec.groups, -1)
        best = _top(grouped, 1 if spec.group_score == "max" else 2)[0].sum(-1)      # [T, groups]
        kept = spread(torch.ones(1, dtype=pick.dtype).expand(best.shape[0], spec.topk_groups),
                      _top(best, spec.topk_groups)[1], spec.groups)                  # 1 in each kept group
        pick = pick.masked_fill(kept.repeat_interleave(grouped.shape[-1], dim=1) == 0, torch.finfo(pick.dtype).min)
    experts = _top(pick, moe.top_k)[1]
    weights = scores.gather(1, experts)
    if moe.norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return weights * spec.routed_scale, experts


def spread(weights: torch.Tensor, experts: torch.Tensor, E: int) -> torch.Tensor:
    """``[T, E]``: each token's top-k weights at its experts, zero elsewhere."""
    return (torch.nn.functional.one_hot(experts, E).to(weights.dtype) * weights.unsqueeze(-1)).sum(1)


def dense(moe: Any, x: torch.Tensor) -> torch.Tensor:
    T, f = x.shape[0], moe.f
    E = moe.experts_gate_up.weight.shape[0]
    weights, experts = choose(moe, moe.router(x))
    gu = torch.bmm(x.unsqueeze(0).expand(E, T, x.shape[1]), moe.experts_gate_up.weight.transpose(1, 2))  # [E, T, 2f]
    if moe.experts_gate_up.bias is not None:
        gu = gu + moe.experts_gate_up.bias.unsqueeze(1)
    h = moe.glu(gu.reshape(E * T, 2 * f), f).reshape(E, T, f)
    y = torch.bmm(h, moe.experts_down.weight.transpose(1, 2))                 # [E, T, hidden]
    if moe.experts_down.bias is not None:
        y = y + moe.experts_down.bias.unsqueeze(1)
    return (y * spread(weights, experts, E).to(x.dtype).T.unsqueeze(-1)).sum(0)


def gathered(moe: Any, x: torch.Tensor) -> torch.Tensor:
    T, f = x.shape[0], moe.f
    k = moe.top_k
    weights, experts = choose(moe, moe.router(x))
    w1 = moe.experts_gate_up.weight.index_select(0, experts.reshape(-1))      # [T k, 2f, h]
    gu = torch.bmm(w1, x.repeat_interleave(k, dim=0).unsqueeze(-1)).squeeze(-1)   # [T k, 2f]
    if moe.experts_gate_up.bias is not None:
        gu = gu + moe.experts_gate_up.bias.index_select(0, experts.reshape(-1))
    h = moe.glu(gu, f)                                                         # [T k, f]
    w2 = moe.experts_down.weight.index_select(0, experts.reshape(-1))         # [T k, h, f]
    y = torch.bmm(w2, h.unsqueeze(-1)).squeeze(-1)                             # [T k, h]
    if moe.experts_down.bias is not None:
        y = y + moe.experts_down.bias.index_select(0, experts.reshape(-1))
    return (y.reshape(T, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(1)


@torch.library.custom_op("twophase::moe", mutates_args=())
def moe_op(x: torch.Tensor, logits: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
           b2: torch.Tensor, k: int, normalize: bool, alpha: float, beta: float, limit: float) -> torch.Tensor:
    """ONNX Runtime's ``MoE`` (``swiglu_fusion = 1``): ``w1 [E, 2f, h]`` with gate and up rows
    interleaved, ``g * sigmoid(alpha * g) * (u + beta)`` with g clamped above and u both ways at
    ``limit``. Run eagerly (a test's reference), every expert on every token."""
    weights, experts = route(logits, k, normalize)
    gu = torch.einsum("th,eoh->teo", x, w1) + b1
    g, u = gu[..., 0::2].clamp(max=limit), gu[..., 1::2].clamp(-limit, limit)
    y = torch.einsum("tef,ehf->teh", g * torch.sigmoid(alpha * g) * (u + beta), w2) + b2
    return torch.einsum("te,teh->th", spread(weights, experts, logits.shape[-1]).to(x.dtype), y)


@moe_op.register_fake
def _(x, logits, w1, b1, w2, b2, k, normalize, alpha, beta, limit):
    return torch.empty_like(x)


def op(moe: Any, x: torch.Tensor) -> torch.Tensor:
    E, two_f, hidden = moe.experts_gate_up.weight.shape
    f = two_f // 2
    glu = moe.glu
    if glu.act == "silu":
        alpha, beta, limit = 1.0, 0.0, float("inf")
    elif glu.act == "clamped_swiglu":
        alpha, beta, limit = glu.alpha, 1.0, glu.limit
    else:
        raise ModelError(f"experts with the {glu.act} gate have no fused MoE operator here")
    w = moe.experts_gate_up.weight
    w1 = torch.stack([w[:, :f], w[:, f:]], dim=2).reshape(E, two_f, hidden)
    b = moe.experts_gate_up.bias
    b1 = (torch.stack([b[:, :f], b[:, f:]], dim=2).reshape(E, two_f) if b is not None
          else torch.zeros(E, two_f, dtype=x.dtype))
    b2 = moe.experts_down.bias if moe.experts_down.bias is not None else torch.zeros(E, hidden, dtype=x.dtype)
    logits, normalize, scale = _as_softmax_routing(moe, moe.router(x))
    out = moe_op(x, logits, w1, b1, moe.experts_down.weight, b2, moe.top_k, normalize, alpha, beta, limit)
    return out if scale is None else out * scale.to(x.dtype)


def _as_softmax_routing(moe: Any, logits: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """Router logits the fused operator (softmax, top k, renormalised or not) reads as
    ``choose`` routes, and a factor a token for its output (None: none). Another routing's
    weights ``w`` go in as ``log w`` at the chosen experts and a logit no softmax keeps
    elsewhere, renormalised: the operator then weighs expert ``i`` by ``w_i / sum(w)``, and
    the output times ``sum(w)`` (the experts' sum is linear in their weights) is the routing's."""
    if moe.spec.routing_is_plain:
        return logits, moe.norm_topk, None
    weights, experts = choose(moe, logits)
    chosen = spread(torch.ones_like(weights), experts, logits.shape[-1]) > 0
    ln = spread(torch.log(weights.clamp_min(1e-30)), experts, logits.shape[-1])
    total = weights.sum(-1, keepdim=True)
    # the operator takes its router logits in the input's dtype (-1e4 and log(1e-30) fit in fp16)
    return ln.masked_fill(~chosen, -1e4).to(logits.dtype), True, total


FORMS = {"op": op, "dense": dense, "gathered": gathered}
