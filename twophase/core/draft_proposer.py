"""Drafts from a second model (``method = "draft"``): a cheaper model with the target's
vocabulary, on its own backend(s) and its own KV pool, proposes the next ``k`` tokens.

Each request has a shadow in the draft's pool, the proposer's own ``Shadow`` (never a
``Request``, whose only writer is the scheduler): the tokens the draft has seen, how many of
them it holds K/V for, and the random stream its drafts draw from. Before drafting, the shadow
is synced to the target's tokens: the K/V of the tokens both agree on is kept (drafts the target
rejected are truncated away, exactly as in the target's pool), the rest (the target's last
token, a kept draft the draft never computed, or at first the whole prompt) is one chunk whose
last row gives the first draft; each further draft is one batched decode step. Drafts are
sampled from the request's own distribution (temperature, top-k/p, min-p, penalties) applied to
the draft's logits, which is the ``q`` the verifier corrects for; a greedy request's drafts are
the draft's argmax.

Limits: a step's catch-up chunks share the target's token budget (a long prompt is caught up
over several steps, without drafts meanwhile); a draft pool that runs short evicts the shadows
drafted least recently; a request that still does not fit gets no drafts. A draft model that
fails costs the step its drafts, never a request: the target decodes on without them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from twophase.contract import Backend
from twophase.core import batch
from twophase.core.distribution import distribution, is_greedy, processed
from twophase.core.executor import Executor
from twophase.core.kv_manager import KVManager
from twophase.core.proposer import Proposal
from twophase.core.request import Request
from twophase.core.seq_state import SeqState

log = logging.getLogger(__name__)


def draft_generator(req: Request) -> torch.Generator | None:
    """A seeded request's drafts draw from a stream of their own: from the request's own, the
    first draft would reuse the random numbers that picked the token before it, and so repeat
    it far more often than ``q`` says (the verifier's correction assumes drafts drawn from
    ``q``). Unseeded requests draw from the global generator, as their own tokens do."""
    seed = req.params.seed
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 6364136223846793005 + 1442695040888963407) % 2**63)


@dataclass(eq=False)
class Shadow(SeqState):
    """A request's sequence in the draft's pool, written by the proposer alone."""

    generator: torch.Generator | None = None


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, up to ``limit``."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


class DraftProposer:
    def __init__(self, prefill_backend: Backend, decode_backend: Backend, kv: KVManager,
                 eos_ids: tuple[int, ...], max_tokens_per_step: int):
        self.executor = Executor(prefill_backend, decode_backend)
        self.kv = kv
        self.eos_ids = eos_ids
        self.max_tokens_per_step = max_tokens_per_step
        self.shadows: OrderedDict[str, Shadow] = OrderedDict()   # least recently drafted first
        self.failures = 0

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        try:
            with self.executor.glue():
                return self._propose(reqs, ks)
        except Exception as exc:
            # the shadows' K/V may be half written: drop it (it is recomputed)
            self.failures += 1
            log.error("the draft model failed (%d times so far), so this step has no drafts: %s",
                      self.failures, exc, exc_info=self.failures == 1)
            for req in reqs:
                if req.request_id in self.shadows:
                    self._drop_kv(self.shadows[req.request_id])
            return [Proposal([]) for _ in reqs]

    def release(self, req: Request) -> None:
        shadow = self.shadows.pop(req.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    # -- drafting -----------------------------------------------------------------------------
    def _propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        busy = {r.request_id for r in reqs}
        left = self.max_tokens_per_step
        work = []                     # (index, request, shadow, catch-up tokens, drafts wanted)
        for i, (req, k) in enumerate(zip(reqs, ks)):
            shadow = self._sync(req)
            pending = shadow.num_tokens - shadow.num_computed_tokens
            n = min(pending, left)
            want = k if n == pending else 0          # caught up only this step: no drafts yet
            if n > 0 and self._allocate(shadow, n + max(want - 1, 0), busy):
                work.append((i, req, shadow, n, want))
                left -= n
        drafts: dict[int, list[int]] = {i: [] for i, *_ in work}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in work}
        if not work:
            return [Proposal([]) for _ in reqs]
        # the catch-up chunks, whose last rows give the first drafts
        decodes = [s for _, _, s, n, _ in work if n == 1]
        prefills = [(s, n) for _, _, s, n, _ in work if n > 1]
        batches = batch.build_phases(decodes, prefills, self.kv,
                                     self.executor.one_call(len(decodes)))
        logits = self.executor.run(batches)
        last, row = {}, 0
        for shadow, n, k in batches.rows:
            row += k
            last[shadow.request_id] = row - 1
            shadow.num_computed_tokens += n
        active = [w for w in work if w[4] > 0]
        rows = [last[s.request_id] for _, _, s, _, _ in active]
        while active:
            for (i, req, shadow, _, _), row_logits in zip(active, logits[rows]):
                token, q = self._draw(row_logits, req, shadow, drafts[i])
                drafts[i].append(token)
                shadow.token_ids.append(token)
                if q is not None:
                    probs[i].append(q)
            active = [w for w in active if len(drafts[w[0]]) < w[4]]
            if active:                                  # the next drafts: one decode step
                shadows = [s for _, _, s, _, _ in active]
                logits = self.executor.decode_backend.decode(batch.decode_batch(shadows, self.kv))
                for s in shadows:
                    s.num_computed_tokens += 1
                rows = list(range(len(active)))
        proposals = [Proposal([]) for _ in reqs]
        for i in drafts:
            proposals[i] = Proposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return proposals

    def _draw(self, row: torch.Tensor, req: Request, shadow: Shadow,
              drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """A draft token for ``req`` after ``drafted``, and the distribution ``q`` it was drawn
        from (None: greedy, the argmax)."""
        row = processed(row, req, self.eos_ids, drafted)
        if is_greedy(req):
            return int(row.argmax()), None
        q = distribution(row, req).cpu()
        return int(torch.multinomial(q, 1, generator=shadow.generator)), q

    def _sync(self, req: Request) -> Shadow:
        """``req``'s shadow, holding the target's tokens and the K/V the draft can keep."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Shadow(req.request_id, list(req.token_ids), generator=draft_generator(req))
            self.shadows[req.request_id] = shadow
            return shadow
        self.shadows.move_to_end(req.request_id)
        keep = common_prefix(shadow.token_ids, req.token_ids, shadow.num_computed_tokens)
        shadow.token_ids = list(req.token_ids)
        shadow.num_computed_tokens = keep
        self.kv.truncate(shadow, keep)
        return shadow

    def _allocate(self, shadow: Shadow, n: int, busy: set[str]) -> bool:
        """Blocks for ``n`` more tokens of ``shadow``, evicting idle shadows (least recently
        drafted first) while the pool is short."""
        while not self.kv.allocate(shadow, n):
            idle = next((s for rid, s in self.shadows.items()
                         if rid not in busy and self.kv.block_table(s)), None)
            if idle is None:
                return False
            self._drop_kv(idle)
        return True

    def _drop_kv(self, shadow: Shadow) -> None:
        """Free ``shadow``'s blocks; it keeps its random stream (a seeded request's draws
        must not start over) and computes its tokens again when it drafts next."""
        self.kv.free(shadow)
        shadow.num_computed_tokens = 0
