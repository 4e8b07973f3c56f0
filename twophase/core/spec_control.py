"""``num_tokens = "auto"``: how many drafts each decode gets, from what drafts have bought.

A verify pass costs time in proportion to the tokens it computes; decode steps are measured as
they run and fitted to ``seconds = a + b * tokens`` (``a``: reading the weights once; ``b``: each
token's own work). A request's drafts are kept at a running rate ``alpha``, so its ``j``-th draft
is kept with probability ``alpha ** j``. Drafts are handed out one at a time to the request whose
next one is most likely kept, while its expected tokens per second of added step time beat the
step's tokens per second so far: in a memory-bound step (``b`` small against ``a``) drafts are
nearly free and many are given; where each token costs real compute (large batches) or drafts
are rarely kept, none are, and decoding runs as it would without speculation.
"""

from __future__ import annotations

from collections import deque

from twophase.core.request import Request

WINDOW = 64                 # decode steps the cost fit remembers
PRIOR = (1.0, 2.0)          # a new request's acceptance: (kept + 1) / (tried + 2) = 0.5


class SpecController:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)   # (decode tokens, seconds)

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

    @staticmethod
    def acceptance(req: Request) -> float:
        kept, tried = req.num_accepted_tokens + PRIOR[0], req.num_draft_tokens + PRIOR[1]
        return min(kept / tried, 0.99)

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
