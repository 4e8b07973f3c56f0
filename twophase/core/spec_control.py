"""``num_tokens = "auto"``: how many drafts each decode gets, from what drafts have bought.

A verify pass costs time in proportion to the tokens it computes; decode steps are measured as
they run and fitted to ``seconds = a + b * tokens`` (``a``: reading the weights once; ``b``: each
token's own work). A request's drafts are kept at a running rate ``alpha``, so its ``j``-th draft
is kept with probability ``alpha ** j``; a request with no record yet starts from the rate of
recent steps' drafts, all requests together (a short chat answer at a large batch must not pay
for drafts while it learns what every chat answer before it showed). Drafts are handed out one
at a time to the request whose next one is most likely kept, while its expected tokens per
second of added step time beat the step's tokens per second so far: in a memory-bound step
(``b`` small against ``a``) drafts are nearly free and many are given; where each token costs
real compute (large batches) or drafts are rarely kept, none are, and decoding runs as it would
without speculation.
"""

from __future__ import annotations

from collections import deque

from twophase.core.request import Request

WINDOW = 64                 # decode steps the cost fit remembers
PRIOR_WEIGHT = 2.0          # drafts' worth of evidence the shared rate counts for in a request's
DECAY = 0.99                # a step's weight in the shared rate, against the step after it


class SpecController:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)   # (decode tokens, seconds)
        self._kept, self._tried = 0.0, 0.0          # drafts of recent steps, decayed

    def learn(self, drafted: int, kept: int) -> None:
        """A step's drafts verified and kept, all requests together."""
        self._kept = self._kept * DECAY + kept
        self._tried = self._tried * DECAY + drafted

    @property
    def shared_rate(self) -> float:
        """The recent acceptance of everyone's drafts (0.5 before any)."""
        return (self._kept + 1.0) / (self._tried + 2.0)

    def observe(self, decode_tokens: int, seconds: float) -> None:
        """A decode-only step's size (decodes plus drafts) and duration."""
        self._steps.append((decode_tokens, seconds))

    def cost(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds = a + b * tokens`` over recent decode steps; None until steps
        of at least two sizes were seen."""
        if len({t for t, _ in self._steps}) < 2:
            return None
        n = len(self._steps)
        mt = sum(t for t, _ in self._steps) / n
        ms = sum(s for _, s in self._steps) / n
        var = sum((t - mt) ** 2 for t, _ in self._steps)
        b = max(0.0, sum((t - mt) * (s - ms) for t, s in self._steps) / var)
        return max(ms - b * mt, 1e-9), b

    def acceptance(self, req: Request) -> float:
        kept = req.num_accepted_tokens + PRIOR_WEIGHT * self.shared_rate
        return min(kept / (req.num_draft_tokens + PRIOR_WEIGHT), 0.99)

    def plan(self, reqs: list[Request]) -> dict[str, int]:
        """Drafts for each decode this step (request id -> k, 0 for none)."""
        k = {r.request_id: 0 for r in reqs}
        fit = self.cost()
        if fit is None:                  # explore: the fit needs steps of different sizes
            return {r: self.max_tokens for r in k}
        a, b = fit
        tokens, seconds = float(len(reqs)), a + b * len(reqs)
        alpha = {r.request_id: self.acceptance(r) for r in reqs}
        while True:
            best = max(reqs, key=lambda r: alpha[r.request_id] ** (k[r.request_id] + 1)
                       if k[r.request_id] < self.max_tokens else -1.0, default=None)
            if best is None or k[best.request_id] >= self.max_tokens:
                return k
            gain = alpha[best.request_id] ** (k[best.request_id] + 1)
            if b > 0 and gain / b <= tokens / seconds:
                return k
            k[best.request_id] += 1
            tokens, seconds = tokens + gain, seconds + b
