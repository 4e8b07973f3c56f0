"""``num_tokens = "auto"``: how many drafts each decode gets, from what drafts have bought.

Decode steps are timed as they run, in two kinds. Steps that verify drafts are fitted to
``seconds = a + b * tokens`` (``a``: reading the weights once, and whatever a verify pass costs
over a plain step; ``b``: each token's own work, drafting included); plain steps (no drafts) are
the baseline. A request's drafts are kept at a running rate ``alpha``, so its ``j``-th draft is
kept with probability ``alpha ** j``; a request with no record yet starts from the rate of recent
steps' drafts, all requests together (a short chat answer at a large batch must not pay for
drafts while it learns what every chat answer before it showed). Drafts are handed out one at a
time to the request whose next one is most likely kept, while its expected tokens per second of
added step time beat the step's so far; then the whole plan must beat a plain step of the same
decodes, or no one drafts. In a memory-bound step drafts are nearly free and many are given;
where each token costs real compute (large batches), where a verify pass costs more than the
tokens it adds (a batch that leaves the backend's fastest decode path for a few drafts), or where
drafts are rarely kept, none are, and decoding runs as it would without speculation. Every
``REFRESH`` drafting steps one plain step is taken, and every ``REFRESH`` plain steps the plan
is tried again without the comparison, so neither side's timing goes stale.
"""

from __future__ import annotations

from collections import deque

from twophase.core.request import Request

WINDOW = 64                 # decode steps of each kind remembered
REFRESH = 32                # drafting steps between two plain ones
PRIOR_WEIGHT = 2.0          # drafts' worth of evidence the shared rate counts for in a request's
DECAY = 0.99                # a step's weight in the shared rate, against the step after it


class SpecController:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._verify: deque[tuple[int, float]] = deque(maxlen=WINDOW)   # (tokens, seconds)
        self._plain: deque[tuple[int, float]] = deque(maxlen=WINDOW)    # (decodes, seconds)
        self._since_plain = self._since_verify = 0      # steps since one of the other kind
        self._kept, self._tried = 0.0, 0.0          # drafts of recent steps, decayed

    def learn(self, drafted: int, kept: int) -> None:
        """A step's drafts verified and kept, all requests together."""
        self._kept = self._kept * DECAY + kept
        self._tried = self._tried * DECAY + drafted

    @property
    def shared_rate(self) -> float:
        """The recent acceptance of everyone's drafts (0.5 before any)."""
        return (self._kept + 1.0) / (self._tried + 2.0)

    def observe(self, decodes: int, drafts: int, seconds: float) -> None:
        """A decode-only step: its sequences, their drafts, its duration."""
        if drafts:
            self._verify.append((decodes + drafts, seconds))
            self._since_plain, self._since_verify = self._since_plain + 1, 0
        else:
            self._plain.append((decodes, seconds))
            self._since_plain, self._since_verify = 0, self._since_verify + 1

    def cost(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds = a + b * tokens`` over recent verify steps; None until steps
        of at least two sizes were seen."""
        return _fit(self._verify)

    def plain_seconds(self, decodes: int) -> float | None:
        """What a plain step of ``decodes`` sequences costs, from recent plain steps."""
        if not self._plain:
            return None
        fit = _fit(self._plain)
        if fit is None:                       # one size seen: a memory-bound step's cost
            return sum(s for _, s in self._plain) / len(self._plain)
        return fit[0] + fit[1] * decodes

    def acceptance(self, req: Request) -> float:
        kept = req.num_accepted_tokens + PRIOR_WEIGHT * self.shared_rate
        return min(kept / (req.num_draft_tokens + PRIOR_WEIGHT), 0.99)

    def plan(self, reqs: list[Request]) -> dict[str, int]:
        """Drafts for each decode this step (request id -> k, 0 for none)."""
        k = {r.request_id: 0 for r in reqs}
        fit = self.cost()
        if fit is None:                  # explore: the fit needs steps of different sizes
            return {r: self.max_tokens for r in k}
        plain = self.plain_seconds(len(reqs))
        if plain is None or self._since_plain >= REFRESH:
            return k                     # measure the baseline
        a, b = fit
        tokens, seconds = float(len(reqs)), a + b * len(reqs)
        alpha = {r.request_id: self.acceptance(r) for r in reqs}
        while True:
            best = max(reqs, key=lambda r: alpha[r.request_id] ** (k[r.request_id] + 1)
                       if k[r.request_id] < self.max_tokens else -1.0, default=None)
            if best is None or k[best.request_id] >= self.max_tokens:
                break
            gain = alpha[best.request_id] ** (k[best.request_id] + 1)
            if b > 0 and gain / b <= tokens / seconds:
                break
            k[best.request_id] += 1
            tokens, seconds = tokens + gain, seconds + b
        if tokens / seconds <= len(reqs) / plain and self._since_verify < REFRESH:
            return dict.fromkeys(k, 0)                   # a plain step does better
        return k


def _fit(steps: deque[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares ``seconds = a + b * tokens`` (``b >= 0``); None under two sizes."""
    if len({t for t, _ in steps}) < 2:
        return None
    n = len(steps)
    mt = sum(t for t, _ in steps) / n
    ms = sum(s for _, s in steps) / n
    var = sum((t - mt) ** 2 for t, _ in steps)
    b = max(0.0, sum((t - mt) * (s - ms) for t, s in steps) / var)
    return max(ms - b * mt, 1e-9), b
