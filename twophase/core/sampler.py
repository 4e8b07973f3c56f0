"""Turns a step's logits into tokens, one row per request, honouring each request's params.

A batch where every request is greedy with no penalties is one ``argmax``; otherwise rows are
processed one by one (penalties, min_tokens, temperature, top-k, top-p, min-p, seeded draw).
Log-probabilities are those of the model's raw distribution.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from twophase.core.distribution import distribution, is_greedy, processed
from twophase.core.outputs import SampledTokens
from twophase.core.proposer import Proposal
from twophase.core.request import Request
from twophase.core.verify import verify
from twophase.structured.masks import StepMasks
from twophase.structured.masks import apply as apply_masks


def sample_step(logits: torch.Tensor, rows: list[tuple[Request, int, int]],
                eos_ids: tuple[int, ...],
                drafts: Mapping[str, Proposal] | None = None,
                masks: StepMasks | None = None) -> dict[str, SampledTokens]:
    """A step's tokens: ``rows[i] = (request, tokens computed, logits rows)`` says whose rows
    of ``logits`` come next. Only sequences whose tokens are all computed after the step are
    sampled (a prompt's last chunk, a decode); a chunk in the middle of a prompt has no next
    token yet. A decode with ``drafts`` is verified over its rows (``core/verify.py``).
    ``masks`` (structured outputs) forbid tokens per request; log-probabilities stay the
    model's own."""
    drafts, masks = drafts or {}, masks or {}
    picks, spans, start = [], [], 0
    prompt_lps = {}                     # chunks whose every row came back (``batch.build``)
    for req, n, k in rows:
        if req.request_id in drafts:
            spans.append((req, start, k))
        elif req.num_computed_tokens + n == req.num_tokens:
            picks.append((req, start + k - 1))
        if k == n and req.wants_prompt_logprobs and req.request_id not in drafts:
            prompt_lps[req.request_id] = prompt_logprobs(logits[start:start + k], req)
        start += k
    out: dict[str, SampledTokens] = {}
    if picks:
        index = [i for _, i in picks]
        chosen = logits[index] if len(index) < logits.shape[0] else logits
        tokens, logprobs = sample(chosen, [r for r, _ in picks], eos_ids,
                                  [masks.get(r.request_id) for r, _ in picks])
        out = {r.request_id: SampledTokens([t], None if lp is None else [lp], prompt_lps.pop(r.request_id, None))
               for (r, _), t, lp in zip(picks, tokens, logprobs)}
    out |= {rid: SampledTokens([], None, lps) for rid, lps in prompt_lps.items()}   # mid-prompt chunks
    for req, first, k in spans:
        rows_of = logits[first:first + k]
        mask = masks.get(req.request_id)
        tokens = verify(rows_of if mask is None else apply_masks(rows_of, mask), req,
                        drafts[req.request_id], eos_ids)
        n_lp = req.params.logprobs
        lps = None if n_lp is None else [_top_logprobs(rows_of[j], t, n_lp) for j, t in enumerate(tokens)]
        out[req.request_id] = SampledTokens(tokens, lps)
    return out


def sample(logits: torch.Tensor, reqs: list[Request], eos_ids: tuple[int, ...],
           masks: list[np.ndarray | None] | None = None) -> tuple[list[int], list[dict[int, float] | None]]:
    """``logits [len(reqs), vocab]`` float32 → (token ids, per-row top-n logprob dicts or None)."""
    rows = logits
    given = [(i, m[:1]) for i, m in enumerate(masks or []) if m is not None]
    if given:
        where = [i for i, _ in given]
        rows = logits.clone()
        rows[where] = apply_masks(logits[where], np.concatenate([m for _, m in given]))
    simple = all(r.params.greedy and not r.params.needs_penalties
                 and r.num_output_tokens >= r.params.min_tokens for r in reqs)
    if simple:
        tokens = argmax_rows(rows)
    else:
        tokens = [_sample_row(row, r, eos_ids) for row, r in zip(rows, reqs)]
    logprobs = [_top_logprobs(logits[i], tok, r.params.logprobs) if r.params.logprobs is not None
                else None for i, (tok, r) in enumerate(zip(tokens, reqs))]
    return tokens, logprobs


def argmax_rows(rows: torch.Tensor) -> list[int]:
    """Each row's first largest logit. On the CPU through numpy, whose vectorised argmax is
    several times torch's on one thread (docs/measurements.md), the thread count a step runs
    torch at beside a native backend."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return rows.numpy().argmax(axis=-1).tolist()
    return rows.argmax(dim=-1).tolist()


def _sample_row(row: torch.Tensor, req: Request, eos_ids: tuple[int, ...]) -> int:
    row = processed(row, req, eos_ids)
    if is_greedy(req):
        return int(row.argmax())
    return int(torch.multinomial(distribution(row, req).cpu(), 1, generator=req.generator))


def prompt_logprobs(rows: torch.Tensor, req: Request) -> tuple[int, list[dict[int, float]]]:
    """The log-probabilities of the prompt tokens a chunk's rows predict: row ``j`` of a chunk
    from position ``p`` gives token ``p + j + 1``'s (the chunk's last row, after the prompt's
    last token, predicts the first output token: not a prompt token). ``(p + 1, dicts)``, each
    dict the token's own and the top ``params.prompt_logprobs``."""
    first = req.num_computed_tokens + 1
    targets = req.token_ids[first:min(first + rows.shape[0], req.num_prompt_tokens)]
    lp = torch.log_softmax(rows[:len(targets)].float(), dim=-1)
    own = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    n = req.params.prompt_logprobs or 0
    tops = lp.topk(n) if n else None
    out = []
    for j, (tok, v) in enumerate(zip(targets, own)):
        d = {tok: v}
        if tops is not None:
            d.update(zip(tops.indices[j].tolist(), tops.values[j].tolist()))
            d[tok] = v
        out.append(d)
    return first, out


def _top_logprobs(row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    lp = torch.log_softmax(row.float(), dim=-1)
    out = {token: float(lp[token])}
    if n > 0:
        vals, ids = lp.topk(n)
        out.update({int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())})
    return out
