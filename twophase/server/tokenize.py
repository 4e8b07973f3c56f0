"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's server offers them: a client counts a
prompt's tokens (or sees what a chat request's template makes of its messages) before it sends
it, and reads token ids back as text, with the served model's own tokenizer.

Nothing is generated, so nothing reaches the engine: the work runs in a worker thread, off the
event loop. Bad input is a 400 naming the field: a prompt and messages together, neither, or a
token id outside the vocabulary.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from twophase.server import chat
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of

if TYPE_CHECKING:
    from twophase.models.tokenizer import Tokenizer

router = APIRouter()


class TokenizeRequest(BaseModel):
    """A text prompt (``prompt``) or a chat (``messages``, through the chat template); vLLM's
    defaults: special tokens added to a text prompt, not to a rendered chat (its template
    writes them)."""
    model_config = P.STRICT
    model: str | None = None
    prompt: P.Text | None = None
    messages: Annotated[list[P.ChatMessage], Field(min_length=1, max_length=P.MAX_MESSAGES)] | None = None
    tools: Annotated[list[P.Tool], Field(max_length=P.MAX_TOOLS)] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = P.STRICT
    model: str | None = None
    tokens: list[P.TokenId]


def _tokenizer(server: ServerState, model: str | None, field: str) -> Tokenizer:
    if model is not None:
        server.adapter_of(model)            # an adapter shares the base model's tokenizer
    if server.tokenizer is None:
        raise P.ApiError(400, "this model has no tokenizer", field)
    return server.tokenizer


def _text(server: ServerState, body: TokenizeRequest) -> tuple[str, bool]:
    """The text to tokenise and whether special tokens are added to it."""
    if body.prompt is not None and body.messages is not None:
        raise P.ApiError(400, "give prompt or messages, not both", "messages")
    if body.prompt is None and body.messages is None:
        raise P.ApiError(400, "missing required parameter: prompt (or messages, for a chat)", "prompt")
    if body.messages is None:
        for field in ("add_generation_prompt", "tools"):
            if getattr(body, field) is not None:
                raise P.ApiError(400, f"{field} applies to messages only, not to a prompt", field)
        return body.prompt or "", body.add_special_tokens is not False
    request = P.ChatCompletionRequest(model=server.model_name, messages=body.messages, tools=body.tools)
    tools = chat.plan_tools(server, request)
    generation = body.add_generation_prompt is not False
    return chat.render(server, request, tools, add_generation_prompt=generation), bool(body.add_special_tokens)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    server = state_of(request)
    tok = _tokenizer(server, body.model, "prompt" if body.messages is None else "messages")
    text, special = _text(server, body)
    tokens = await asyncio.to_thread(tok.encode, text, special)
    return {"count": len(tokens), "max_model_len": server.loop.max_model_len, "tokens": tokens}


def _decode(tok: Tokenizer, tokens: list[int]) -> str:
    """The tokens' text, special tokens written out (a rendered chat reads back whole)."""
    size = max(tok.vocabulary().values()) + 1
    bad = next((t for t in tokens if t >= size), None)
    if bad is not None:
        raise P.ApiError(400, f"token id {bad} is outside the vocabulary (ids 0 to {size - 1})", "tokens")
    return tok.decode(tokens, skip_special_tokens=False)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    server = state_of(request)
    tok = _tokenizer(server, body.model, "tokens")
    return {"prompt": await asyncio.to_thread(_decode, tok, body.tokens)}
