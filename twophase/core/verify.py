"""Speculative verification: which drafted tokens the target model keeps, with the target's
distribution exactly preserved (Leviathan et al. 2023; Chen et al. 2023).

The verify pass gives the target's logits at each drafted position and one past them. Position
``j`` keeps draft token ``d`` with probability ``min(1, p(d) / q(d))`` (``p`` the target's
distribution after temperature, top-k, top-p, min-p and penalties; ``q`` the draft's); the first
rejection draws from ``normalize(max(0, p - q))`` instead and ends the run; if every draft is
kept, one more token comes from the target's last row. A proposal without ``q`` (n-gram lookup)
is one-hot: ``d`` is kept with probability ``p(d)``, else a token is drawn from ``p`` without
``d``. Greedy requests keep a draft exactly when it is the target's argmax, so their output is
token for token the target's own greedy output, and no random number is drawn.
"""

from __future__ import annotations

import torch

from twophase.core.distribution import distribution, is_greedy, processed
from twophase.core.proposer import Proposal
from twophase.core.request import Request


def verify(logits: torch.Tensor, req: Request, proposal: Proposal,
           eos_ids: tuple[int, ...]) -> list[int]:
    """``logits [len(drafts) + 1, vocab]``: the target at each drafted position and one past.
    Returns the kept drafts followed by one token from the target."""
    drafts = proposal.token_ids
    out: list[int] = []
    for j, d in enumerate(drafts):
        row = processed(logits[j], req, eos_ids, drafts[:j])
        if is_greedy(req):
            t = int(row.argmax())
        elif proposal.probs is None:
            # one-hot q: drawing t from p and keeping d when t == d keeps d with probability p(d)
            # and otherwise gives p without d, exactly as accept_or_resample does, with one draw
            # per token emitted: a seeded request draws what it would without speculation
            t = int(torch.multinomial(distribution(row, req).cpu(), 1, generator=req.generator))
        else:
            p = distribution(row, req).cpu()
            q = proposal.probs[j].float().cpu()
            t = int(accept_or_resample(p, q, torch.tensor([d]), req.generator)[0])
        out.append(t)
        if t != d:
            return out
    row = processed(logits[len(drafts)], req, eos_ids, drafts)
    if is_greedy(req):
        out.append(int(row.argmax()))
    else:
        probs = distribution(row, req).cpu()
        out.append(int(torch.multinomial(probs, 1, generator=req.generator)))
    return out


def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """One drafted position, for ``len(drafts)`` independent trials at once: each draft token
    where it is accepted, else a draw from the residual. Whatever ``q`` proposed, the result is
    distributed as ``p`` (the tests draw 10^6 trials and measure it)."""
    pd = p[drafts]
    ratio = pd if q is None else torch.clamp(pd / q[drafts], max=1.0)
    accepted = torch.rand(drafts.shape, generator=generator) < ratio
    rest = residual(p, q, drafts)                                       # [trials or 1, vocab]
    if rest.shape[0] == 1:
        redrawn = torch.multinomial(rest[0], drafts.shape[0], replacement=True, generator=generator)
    else:
        redrawn = torch.multinomial(rest, 1, generator=generator)[:, 0]
    return torch.where(accepted, drafts, redrawn)


def residual(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """Where a rejected position draws from: ``normalize(max(0, p - q))`` (one row for every
    trial), or for a one-hot ``q`` at each trial's draft, ``p`` without that token (a row per
    trial). Where nothing is left (``p`` equal to ``q``, where rejection cannot happen), ``p``."""
    if q is None:
        rest = p.expand(drafts.shape[0], -1).clone()
        rest[torch.arange(drafts.shape[0]), drafts] = 0.0
    else:
        rest = torch.clamp(p - q, min=0.0).unsqueeze(0)
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=1e-30), p.expand_as(rest))
