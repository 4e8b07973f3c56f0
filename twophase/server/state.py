"""What every route of one server shares: the engine loop, the metrics, the served name."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    adapters: Any = None             # the engine's ``LoraManager`` (None: it serves none)
    hidden_size: int | None = None   # an embedding's length (None: not known here)

    def adapter_names(self) -> Collection[str]:
        return () if self.adapters is None else self.adapters.known

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); a 404 otherwise."""
        from twophase.server.protocol import check_model

        return check_model(model, self.model_name, self.adapter_names())


def state_of(request: Request) -> ServerState:
    return request.app.state.server
