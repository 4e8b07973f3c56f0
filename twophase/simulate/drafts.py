"""Speculative decoding in the simulator: drafts the engine's own verification keeps or
rejects. The simulated target's argmax is one fixed token; each drafted position is that token
with probability ``acceptance`` (independently), else another one, so the real scheduler,
verification and K/V rollback decide what is kept, and the kept run is as long as a real
proposer of that per-token acceptance rate would get."""

from __future__ import annotations

import random
from collections.abc import Sequence

from twophase.core.proposer import Proposal
from twophase.core.request import Request


class AcceptingProposer:
    def __init__(self, token: int, acceptance: float, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.token, self.acceptance = token, acceptance
        self._rng = random.Random(seed)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        return [Proposal([self.token if self._rng.random() < self.acceptance else self.token + 1
                          for _ in range(k)]) for k in ks]

    def release(self, req: Request) -> None:
        pass                                         # keeps nothing a request
