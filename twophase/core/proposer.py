"""The interfaces the step loop is built to take next, each with its one place of entry.

- ``Proposer`` (speculative decoding; ``core/ngram.py`` and ``core/draft_proposer.py``): the
  scheduler asks it, once a step for all of them, for up to ``k`` draft tokens of each sequence
  in decode, and schedules them as a ``k + 1``-token chunk
  after the cached tokens, verified in one ``prefill`` with ``logits = "all"``
  (``core/verify.py``). ``Scheduler.update_from_output`` takes the kept drafts and one token
  through the stop rules, counts as computed only what was kept, and ``KVManager.truncate``
  returns the blocks wholly past that length to the pool (rejected slots in a kept block are
  overwritten later; only committed tokens are ever hashed for the prefix cache).
- ``KVConnector`` (K/V computed by another engine; ``core/kv_transfer.py``): a scheduler half,
  asked at admission how many of a request's tokens a peer holds and, when a request finishes,
  whether its blocks are kept for a peer under a lease; and a worker half that writes pulled
  blocks into the pool before the step that counts them. The layout it moves is ``KVLayout``
  (a value of ``core/kv_params.py``), checked on both sides at start-up. Phases routed to two
  backends in one process are its zero-copy case: the pool is shared, nothing moves.
- Admission: ``core/admission.py`` (a watermark of free blocks kept for running sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from twophase.core.kv_params import KVLayout

if TYPE_CHECKING:
    import torch

    from twophase.core.request import Request

__all__ = ["KVLayout", "Proposal", "Proposer"]      # KVLayout lives in core/kv_params.py


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence; ``probs [len(token_ids), vocab]`` is the draft model's
    distribution at each (``None``: a one-hot proposal, as n-gram lookup makes)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal]:
        """For each request, up to its ``k`` tokens likely to follow its ``token_ids`` (fewer,
        or none, is fine)."""
        ...

    def release(self, req: Request) -> None:
        """``req`` is finished: drop whatever was kept for it."""
        ...
