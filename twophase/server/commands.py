"""What HTTP handlers ask of the engine's thread (``EngineLoop``), one value a kind: the thread
takes them off a queue between steps, and only it touches the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twophase.core.engine_values import PreparedPrompt
from twophase.core.kv_transfer import KVTransferParams
from twophase.core.pooling import PoolingParams
from twophase.core.sampling_params import SamplingParams

Sink = Callable[[Any], None]        # takes a request's deltas, its ``Finished`` or an exception


@dataclass(frozen=True)
class Submit:
    """Add a request; its deltas go to ``sink``."""

    request_id: str
    prompt: PreparedPrompt | list[int]       # prepared: checked already, not again
    params: SamplingParams
    sink: Sink
    kv_transfer: KVTransferParams | None = None
    first_token_ids: tuple[int, ...] = ()
    constraint: Any = None                   # a grammar state compiled off the engine's thread
    # the other choices of ``params.n``: each one's request id and sink
    choices: tuple[tuple[str, Sink], ...] = ()
    priority: int = 0                        # the lower value starts first (its choices' too)
    pooling: PoolingParams | None = None     # an embedding: prefill-only, pooled

    @property
    def sinks(self) -> list[Sink]:
        return [self.sink, *(sink for _, sink in self.choices)]


@dataclass(frozen=True)
class Abort:
    """Stop a request now and free its blocks (its client went away)."""

    request_id: str


@dataclass(frozen=True)
class FailAll:
    """End every open request with an error (shutdown past its deadline)."""

    message: str


@dataclass(frozen=True)
class Call:
    """Run ``fn`` between steps (what must not race one)."""

    fn: Callable[[], Any]


@dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes a waiting loop so it sees it must stop."""


Command = Submit | Abort | FailAll | Call | Wake
