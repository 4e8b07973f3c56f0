"""What the KV manager and the batch builders read of a sequence: its id, its tokens and how
many of them have K/V in the pool.

``Seq`` is that view, read-only, so a ``Request`` (whose only writer is the scheduler) is one as
it stands. ``SeqState`` is a plain value that is one too, for a sequence whose state is not a
request's: the draft model's copy of a request in its own pool, written by the draft proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Seq(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose K/V are in the pool."""
        ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(eq=False)          # a sequence is one thing over time, not equal to its copies
class SeqState:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
