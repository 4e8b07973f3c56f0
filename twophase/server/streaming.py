"""The one path from a request to a reply, shared by every generating endpoint: check and
tokenise the prompts (off the engine's thread), submit them, then either collect the whole
outputs or stream server-sent events. An endpoint only says how its replies look (a
``Formatter``); a request with several prompts gets ``params.n`` choices a prompt, in order
(choice ``p * n + i`` is prompt ``p``'s ``i``-th). ``/v1/responses``, whose events are not
choices' chunks, builds its reply from the same pieces (``start``, ``collect``, ``merged``,
``event_stream``).

A client that goes away, mid-stream or while waiting for a whole reply, has its requests
aborted and their KV blocks freed at once. An engine failure mid-stream is an error event,
then ``[DONE]``: a stream always ends.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from twophase.core.outputs import Delta, RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected
from twophase.server import protocol as P
from twophase.server.loop import EngineError, EngineLoop, EngineStopped, Finished, Handle, Overloaded

DISCONNECT_POLL_S = 0.25


class Formatter(Protocol):
    """How one endpoint's replies look; ``index`` is the choice's place among all."""

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed reply."""
        ...

    def chunk(self, delta: Delta, index: int) -> dict[str, Any] | None:
        """A stream event for one step's tokens (None: nothing to send)."""
        ...

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        """The event that ends one choice (its finish reason)."""
        ...

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        """The last event before ``[DONE]`` (usage, where asked), or None."""
        ...


async def respond(request: Request, loop: EngineLoop, prompts: list[str | list[int]],
                  params: SamplingParams, stream: bool, fmt: Formatter, max_tokens_field: str = "max_tokens",
                  priority: int = 0):
    """``max_tokens_field``: the name the client gave its length limit, which a refusal names;
    ``priority``: every prompt's, as ``Engine.add_request`` takes it."""
    handles = await start(request, loop, prompts, params, max_tokens_field, priority)
    if not stream:
        outputs = await collect(request, handles)
        return JSONResponse(fmt.whole(outputs))
    return event_stream(_events(handles, fmt), handles)


def event_stream(events: AsyncIterator[str], handles: list[Handle]) -> StreamingResponse:
    """``events`` (server-sent events' text) as the response; the abort runs however the
    response ends, also when it is cancelled before it started."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(abort, handles))


def _rejected(exc: RequestRejected, max_tokens_field: str) -> P.ApiError:
    """A prompt that can never be served, its message naming the length limit as the client
    sent it (the engine's messages say ``max_tokens``)."""
    return P.ApiError(400, re.sub(r"\bmax_tokens\b", max_tokens_field, str(exc)), "prompt",
                      code="prompt_rejected")


async def start(request: Request, loop: EngineLoop, prompts: list[str | list[int]],
                 params: SamplingParams, max_tokens_field: str, priority: int = 0) -> list[Handle]:
    """Check, submit and wait for each request's first item, so refusals become a status, not
    a stream."""
    try:
        ids = [await loop.prepare(p, params) for p in prompts]
    except RequestRejected as exc:
        raise _rejected(exc, max_tokens_field) from None
    try:                                    # one grammar state a prompt (None: unconstrained)
        constraints = [await loop.constrain(params) for _ in prompts]
    except RequestRejected as exc:
        raise P.ApiError(400, str(exc), exc.param or "response_format",
                         code="invalid_structured_output") from None
    return await started(request, [partial(loop.submit_choices, one, params, c, priority=priority)
                                    for one, c in zip(ids, constraints)],
                         lambda exc: _rejected(exc, max_tokens_field))


async def started(request: Request, submits: Iterable[Callable[[], list[Handle]]],
                  rejected: Callable[[RequestRejected], P.ApiError]) -> list[Handle]:
    """Submit each request (its handles: one a choice) and wait for each one's first item: a
    refusal (``rejected`` makes its 400), a full queue or a stopped engine is a status, not a
    stream; what was submitted is aborted then."""
    handles: list[Handle] = []
    try:
        for submit in submits:
            handles += submit()
        await _unless_disconnected(request, _firsts(handles))
        return handles
    except EngineStopped as exc:
        abort(handles)
        raise P.ApiError(503, str(exc), type_="server_error", code="engine_stopped",
                         headers={"Retry-After": "1"}) from None
    except Overloaded as exc:
        abort(handles)
        raise P.ApiError(503, str(exc), type_="server_overloaded", code="overloaded",
                         headers={"Retry-After": "1"}) from None
    except RequestRejected as exc:
        abort(handles)
        raise rejected(exc) from None
    except EngineError as exc:
        abort(handles)
        raise P.ApiError(500, str(exc), type_="server_error", code="engine_error") from None
    except BaseException:                       # cancelled: the client went away
        abort(handles)
        raise


async def _firsts(handles: list[Handle]) -> None:
    for h in handles:
        await h.first()


def abort(handles: list[Handle]) -> None:
    for h in handles:
        h.abort()                   # no-op once finished


async def _until_finished(handle: Handle) -> RequestOutput:
    while not isinstance(item := await handle.next(), Finished):
        pass
    return item.output


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result; ``ApiError(499)`` if the client goes away first (checked every
    ``DISCONNECT_POLL_S``, whether or not tokens are arriving). ``work`` is cancelled either way
    if it has not finished."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise P.ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            # nobody awaits it now: whatever it ends with (cancelled, or an error that raced
            # the cancel) is read here, so asyncio never logs it as "never retrieved"
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def collect(request: Request, handles: list[Handle]) -> list[RequestOutput]:
    """Every output of a non-streamed request; aborts them if the client goes away."""
    try:
        return await _unless_disconnected(request, _all_finished(handles))
    except EngineError as exc:
        raise P.ApiError(500, str(exc), type_="server_error", code="engine_error") from None
    finally:
        abort(handles)


async def _all_finished(handles: list[Handle]) -> list[RequestOutput]:
    """Each handle's output, in order. One task (not a ``gather`` of several): cancelled when
    the client goes away, it ends cancelled and leaves no child's error unread."""
    return [await _until_finished(h) for h in handles]


async def merged(handles: list[Handle]) -> AsyncIterator[tuple[int, Any]]:
    """Every handle's items as they come, tagged with the handle's place."""
    pending = {asyncio.ensure_future(h.next()): i for i, h in enumerate(handles)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                item = task.result()
                yield i, item
                if not isinstance(item, Finished):
                    pending[asyncio.ensure_future(handles[i].next())] = i
    finally:
        for task in pending:
            task.cancel()


async def _events(handles: list[Handle], fmt: Formatter) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(handles)
    try:
        async for i, item in merged(handles):
            if isinstance(item, Finished):
                outputs[i] = item.output
                body = fmt.finish(item.output, i)
            else:
                body = fmt.chunk(item, i)
            if body is not None:
                yield _event(body)
        usage = fmt.usage([o for o in outputs if o is not None])
        if usage is not None:
            yield _event(usage)
    except Exception as exc:         # the engine failed mid-stream: say so, then end the stream
        err = exc if isinstance(exc, P.ApiError) else \
            P.ApiError(500, str(exc), type_="server_error", code="engine_error")
        yield _event(err.body())
    finally:
        abort(handles)              # no-op once finished; frees the blocks of a client gone
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
