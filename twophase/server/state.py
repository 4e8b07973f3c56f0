"""What every route of one server shares: the engine loop, the metrics, the served name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from twophase.models.tokenizer import Tokenizer
    from twophase.server.loop import Loop
    from twophase.server.metrics import ServerMetrics


@dataclass
class ServerState:
    tokenizer: Tokenizer | None
    loop: Loop
    metrics: ServerMetrics
    model_name: str
    default_max_tokens: int
    max_n: int = 16                  # choices a prompt (``n``, ``best_of``)


def state_of(request: Request) -> ServerState:
    return request.app.state.server
