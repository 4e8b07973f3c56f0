"""What a request samples its next token from: its logits after penalties and the
``min_tokens`` ban (``processed``), then temperature, top-k, min-p and top-p (``distribution``).
Plain sampling and speculative verification both read it, so they keep the same target."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twophase.core.request import Request


def is_greedy(req: Request) -> bool:
    p = req.params
    return p.greedy or p.temperature < 1e-5          # a tiny temperature is greedy (and avoids inf)


def processed(row: torch.Tensor, req: Request, eos_ids: tuple[int, ...],
              drafted: Sequence[int] = ()) -> torch.Tensor:
    """The logits after penalties and the ``min_tokens`` ban, for the token that follows
    ``req``'s tokens and then ``drafted`` (speculative tokens not yet accepted)."""
    p = req.params
    row = row.float().clone()
    history = req.token_ids + list(drafted) if drafted else req.token_ids
    if p.needs_penalties:
        row = _penalise(row, req, history)
    if req.num_output_tokens + len(drafted) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if banned:
            row[banned] = float("-inf")
    return row


def distribution(row: torch.Tensor, req: Request) -> torch.Tensor:
    """The probabilities ``req`` samples from, given ``processed`` logits: temperature, top-k,
    min-p, top-p."""
    p = req.params
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) > p.top_p            # keep the smallest set reaching top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


def _penalise(row: torch.Tensor, req: Request, history: list[int]) -> torch.Tensor:
    p = req.params
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out = history[req.num_prompt_tokens:]
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long, device=device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row
