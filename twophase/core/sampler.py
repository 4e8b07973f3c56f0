"""Turns a step's logits into tokens, one row per request, honouring each request's params.

A batch where every request is greedy with no penalties is one ``argmax``; otherwise rows are
processed one by one (penalties, min_tokens, temperature, top-k, top-p, min-p, seeded draw).
Log-probabilities are those of the model's raw distribution.
"""

from __future__ import annotations

import torch

from twophase.core.outputs import SampledTokens
from twophase.core.request import Request


def sample_step(logits: torch.Tensor, rows: list[tuple[Request, int]],
                eos_ids: tuple[int, ...]) -> dict[str, SampledTokens]:
    """A step's tokens: ``logits[i]`` belongs to ``rows[i] = (request, tokens computed)``. Only
    rows that complete their sequence are sampled (a prompt's last chunk, a decode); a chunk in
    the middle of a prompt has no next token yet."""
    picks = [i for i, (req, n) in enumerate(rows) if req.num_computed_tokens + n == req.num_tokens]
    if not picks:
        return {}
    reqs = [rows[i][0] for i in picks]
    chosen = logits[picks] if len(picks) < len(rows) else logits
    tokens, logprobs = sample(chosen, reqs, eos_ids)
    return {r.request_id: SampledTokens([t], None if lp is None else [lp])
            for r, t, lp in zip(reqs, tokens, logprobs)}


def sample(logits: torch.Tensor, reqs: list[Request],
           eos_ids: tuple[int, ...]) -> tuple[list[int], list[dict[int, float] | None]]:
    """``logits [len(reqs), vocab]`` float32 → (token ids, per-row top-n logprob dicts or None)."""
    simple = all(r.params.greedy and not r.params.needs_penalties
                 and r.num_output_tokens >= r.params.min_tokens for r in reqs)
    if simple:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = [_sample_row(row, r, eos_ids) for row, r in zip(logits, reqs)]
    logprobs = [_top_logprobs(logits[i], tok, r.params.logprobs) if r.params.logprobs is not None
                else None for i, (tok, r) in enumerate(zip(tokens, reqs))]
    return tokens, logprobs


def _sample_row(row: torch.Tensor, req: Request, eos_ids: tuple[int, ...]) -> int:
    p = req.params
    row = row.float().clone()
    if p.needs_penalties:
        row = _penalise(row, req)
    if req.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if banned:
            row[banned] = float("-inf")
    if p.greedy or p.temperature < 1e-5:      # a tiny temperature is greedy (and avoids inf)
        return int(row.argmax())
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
    gen = req.generator
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _penalise(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out = req.output_token_ids
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long, device=device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def _top_logprobs(row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    lp = torch.log_softmax(row.float(), dim=-1)
    out = {token: float(lp[token])}
    if n > 0:
        vals, ids = lp.topk(n)
        out.update({int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())})
    return out
