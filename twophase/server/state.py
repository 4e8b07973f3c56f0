"""What every route of one server shares: the engine loop, the metrics, the served name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from twophase.llm import LLM
    from twophase.server.loop import EngineLoop
    from twophase.server.metrics import ServerMetrics


@dataclass
class ServerState:
    llm: LLM
    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    default_max_tokens: int

    @property
    def tokenizer(self):
        return self.llm.tokenizer


def state_of(request: Request) -> ServerState:
    return request.app.state.server
