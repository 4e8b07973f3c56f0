"""Prompt lookup (n-gram) proposals: text that quotes its input repeats it, so the longest
suffix of a sequence that occurred earlier in it proposes the tokens that followed there. No
second model, no forward pass: a search over the sequence's own tokens."""

from __future__ import annotations

from collections.abc import Sequence

from twophase.core.proposer import Proposal
from twophase.core.request import Request


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, k)) for r, k in zip(reqs, ks)]

    def release(self, req: Request) -> None:
        """Nothing is kept between steps."""

    def lookup(self, toks: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens: what followed an earlier occurrence of the longest suffix of
        ``min_n`` to ``max_n`` tokens that recurs: the most recent one with ``k`` tokens after
        it, else the one with the most (in text that repeats a short cycle, the most recent
        occurrence is too close to the end to have ``k`` tokens after it)."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            suffix = toks[-n:]
            last = suffix[-1]
            best: list[int] = []
            for end in range(len(toks) - 2, n - 2, -1):       # ``end``: the earlier match's last
                if toks[end] == last and toks[end - n + 1:end + 1] == suffix:
                    follow = toks[end + 1:end + 1 + k]
                    if len(follow) > len(best):
                        best = follow
                        if len(best) == k:
                            break
            if best:
                return list(best)
        return []
