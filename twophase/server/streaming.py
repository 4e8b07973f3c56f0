"""The one path from a request to a reply, shared by every generating endpoint: submit, then
either collect the whole output or stream server-sent events. An endpoint only says how its
chunks and its whole reply look (a ``Formatter``).

A client that goes away, mid-stream or while waiting for a whole reply, has its request aborted
and its KV blocks freed at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from twophase.core.outputs import Delta, RequestOutput
from twophase.core.params import SamplingParams
from twophase.errors import RequestRejected
from twophase.server import protocol as P
from twophase.server.loop import EngineLoop, Finished, Handle, Overloaded

DISCONNECT_POLL_S = 0.25


class Formatter(Protocol):
    """How one endpoint's replies look."""

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        """The non-streamed reply."""
        ...

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """A stream event for one step's tokens (None: nothing to send)."""
        ...

    def final(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The stream's last events (the finish reason, usage), before ``[DONE]``."""
        ...


async def respond(request: Request, loop: EngineLoop, prompt: str | list[int],
                  params: SamplingParams, stream: bool, fmt: Formatter):
    handle, first = await _start(loop, prompt, params)
    if not stream:
        items = await _collect(request, handle, first)
        return JSONResponse(fmt.whole(items[-1].output))
    return StreamingResponse(_events(handle, first, fmt), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _start(loop: EngineLoop, prompt: str | list[int], params: SamplingParams) -> tuple[Handle, Any]:
    """Submit and wait for the first item, so refusals become a status, not a stream."""
    try:
        handle = loop.submit(prompt, params)
    except Overloaded as exc:
        raise P.ApiError(503, str(exc), type_="server_overloaded", code="overloaded") from None
    try:
        return handle, await handle.next()
    except RequestRejected as exc:
        raise P.ApiError(400, str(exc), "prompt", code="prompt_rejected") from None
    except asyncio.CancelledError:
        handle.abort()
        raise


async def _collect(request: Request, handle: Handle, first: Any) -> list[Any]:
    """Every item of a non-streamed request; aborts it if the client goes away (checked every
    ``DISCONNECT_POLL_S``, whether or not tokens are arriving)."""
    items = [first]
    checked = asyncio.get_running_loop().time()
    try:
        while not isinstance(items[-1], Finished):
            try:
                items.append(await asyncio.wait_for(handle.next(), DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                pass
            now = asyncio.get_running_loop().time()
            if now - checked >= DISCONNECT_POLL_S:
                checked = now
                if await request.is_disconnected():
                    raise P.ApiError(499, "client disconnected")
    finally:
        handle.abort()                  # no-op once finished
    return items


async def _events(handle: Handle, first: Any, fmt: Formatter) -> AsyncIterator[str]:
    try:
        item = first
        while True:
            if isinstance(item, Finished):
                for body in fmt.final(item.output):
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
                return
            body = fmt.chunk(item)
            if body is not None:
                yield f"data: {json.dumps(body)}\n\n"
            item = await handle.next()
    finally:
        handle.abort()           # no-op once finished; frees the blocks of a client gone
