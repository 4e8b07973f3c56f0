"""The interfaces the step loop is built to take next, each with its one place of entry.

- ``Proposer`` (speculative decoding; ``core/ngram.py`` and ``core/draft_proposer.py``): the
  scheduler asks it, once a step for all of them, for up to ``k`` draft tokens of each sequence
  in decode, and schedules them as a ``k + 1``-token chunk
  after the cached tokens, verified in one ``prefill`` with ``logits = "all"``
  (``core/verify.py``). ``Scheduler.update_from_output`` takes the kept drafts and one token
  through the stop rules, counts as computed only what was kept, and ``KVManager.truncate``
  returns the blocks wholly past that length to the pool (rejected slots in a kept block are
  overwritten later; only committed tokens are ever hashed for the prefix cache).
- ``KVConnector`` (K/V computed by another process): a scheduler half, asked at admission how
  many of a request's tokens a peer already holds and, when a request finishes, whether its
  blocks are kept for a peer under a lease; and a worker half, called by the ``Executor`` to load
  blocks into the pool before a step and save them after. The layout it moves is
  ``KVLayout``, checked on both sides at start-up. Phases routed to two backends in one process
  are its zero-copy case: the pool is shared, nothing moves.
- Admission: ``core/admission.py`` (a watermark of free blocks kept for running sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from twophase.core.batch import StepBatches
    from twophase.core.request import Request


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


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on before blocks move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


class KVConnectorScheduler(Protocol):
    def num_external_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """Tokens of ``req`` past ``num_computed_tokens`` that a peer computed and can send."""
        ...

    def request_finished(self, req: Request, block_ids: list[int]) -> bool:
        """True to keep ``block_ids`` for a peer (freed on its acknowledgement or the lease)."""
        ...


class KVConnectorWorker(Protocol):
    def load(self, batches: StepBatches) -> None:
        """Write the blocks peers sent into the pool before the step computes."""
        ...

    def save(self, batches: StepBatches) -> None:
        """Offer the blocks this step completed to peers."""
        ...
