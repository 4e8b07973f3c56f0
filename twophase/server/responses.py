"""``POST /v1/responses``: OpenAI's Responses API over the chat path, stateless.

A request becomes a chat request (``responses_protocol``), so the prompt, tools and structured
outputs are the chat endpoint's own; this module only shapes the reply: a ``response`` object
whose ``output`` holds a ``message`` item and/or ``function_call`` items, or, streamed, the
Responses events (``response.created`` ... ``response.completed``), each with its
``sequence_number``. The start, the abort of a client gone and the end of a stream are
``streaming``'s.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from twophase.core.outputs import Delta, RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.server import chat, streaming
from twophase.server import protocol as P
from twophase.server import responses_protocol as R
from twophase.server import tools as T
from twophase.server.loop import Finished, Handle
from twophase.server.state import ServerState, state_of

router = APIRouter()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@router.post("/v1/responses")
async def responses(body: R.ResponsesRequest, request: Request):
    server = state_of(request)
    body.check_stateless()
    try:
        prompt, params, tools = chat.prepare(server, body.chat())
        handles = await streaming.start(request, server.loop, [prompt], params, "max_output_tokens",
                                        body.priority)
    except P.ApiError as exc:
        raise R.renamed(exc) from None
    reply = Reply(server, body, params, tools)
    if not body.stream:
        (output,) = await streaming.collect(request, handles)
        return JSONResponse(reply.whole(output))
    return streaming.event_stream(_events(handles[0], reply), handles)


async def _events(handle: Handle, reply: Reply) -> AsyncIterator[str]:
    """The stream; an engine failure mid-way is an ``error`` event, and the stream ends."""
    try:
        for event in reply.opening():
            yield _sse(event)
        async for _, item in streaming.merged([handle]):
            events = reply.finish(item.output) if isinstance(item, Finished) else reply.chunk(item)
            for event in events:
                yield _sse(event)
    except Exception as exc:
        err = exc if isinstance(exc, P.ApiError) else \
            P.ApiError(500, str(exc), type_="server_error", code="engine_error")
        yield _sse(reply.event("error", code=err.code or err.type, message=err.message, param=err.param))
    finally:
        streaming.abort([handle])


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


class Reply:
    """One response, whole or as events. Streamed, it keeps the output items as sent, so the
    final ``response`` names the same items (ids) the events did."""

    def __init__(self, server: ServerState, body: R.ResponsesRequest, params: SamplingParams,
                 tools: T.ToolPlan):
        self.server, self.body, self.params, self.tools = server, body, params, tools
        self.id, self.created = new_id("resp"), P.now()
        self.sequence = 0
        self.items: list[dict[str, Any]] = []            # output items, in order, as streamed
        self.message: dict[str, Any] | None = None       # the message item, once begun
        self.call_items: list[dict[str, Any]] = []       # CallStream's calls, by its index
        self.calls = T.CallStream(tools) if tools.mode in ("named", "required") else None
        self.held = (T.HeldText(tools.format) if tools.mode == "auto" and tools.format not in (None, "unknown")
                     else None)

    # the whole reply

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        content, calls = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
        status = _status(output)
        items = [] if content is None else [_message(new_id("msg"), content, status)]
        items += [_call(c["id"], c["function"]["name"], c["function"]["arguments"], status) for c in calls]
        return self.response(status, items, output)

    def response(self, status: str, items: list[dict[str, Any]],
                 output: RequestOutput | None = None) -> dict[str, Any]:
        b, fmt = self.body, (self.body.text.format if self.body.text else None)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "model": self.server.model_name, "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "metadata": b.metadata or {}, "user": b.user,
            "max_output_tokens": self.params.max_tokens, "temperature": self.params.temperature,
            "top_p": self.params.top_p, "parallel_tool_calls": b.parallel_tool_calls,
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, R.NamedFunction)
                            else b.tool_choice or ("auto" if b.tools else "none")),
            "tools": [t.model_dump() for t in b.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "previous_response_id": None, "store": False, "background": False, "truncation": "disabled",
            "usage": None if output is None else _usage(output)}

    # the stream

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}

    def opening(self) -> list[dict[str, Any]]:
        return [self.event(kind, response=self.response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def chunk(self, delta: Delta) -> list[dict[str, Any]]:
        if self.calls is not None:
            return [e for entry in self.calls.feed(delta.text) for e in self._call_entry(entry)]
        return self._text(self.held.feed(delta.text) if self.held is not None else delta.text)

    def _text(self, text: str, begin: bool = False) -> list[dict[str, Any]]:
        """Text for the message item, begun with its first text (``begin``: even without)."""
        out: list[dict[str, Any]] = []
        if self.message is None and (text or begin):
            self.message = _message(new_id("msg"), None, "in_progress")
            out.append(self._added(self.message))
            self.message["content"].append({"type": "output_text", "text": "", "annotations": []})
            out.append(self.event("response.content_part.added", **self._at(self.message), content_index=0,
                                  part=self.message["content"][0]))
        if text:
            self.message["content"][0]["text"] += text
            out.append(self.event("response.output_text.delta", **self._at(self.message), content_index=0,
                                  delta=text, logprobs=[]))
        return out

    def _call_entry(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """One of ``CallStream``'s entries: a call's head (its item added), or arguments."""
        if "id" in entry:
            item = _call(entry["id"], entry["function"]["name"], "", "in_progress")
            self.call_items.append(item)
            return [self._added(item)]
        return self._arguments(self.call_items[entry["index"]], entry["function"]["arguments"])

    def _arguments(self, item: dict[str, Any], text: str) -> list[dict[str, Any]]:
        item["arguments"] += text
        return [self.event("response.function_call_arguments.delta", **self._at(item), delta=text)]

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def finish(self, output: RequestOutput) -> list[dict[str, Any]]:
        """What the text held back or never began comes out, then every item is done."""
        out = []
        if self.held is not None:                       # auto: the held text, read for calls
            _, calls = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
            if not calls:
                out += self._text(self.held.rest())
            for c in calls:
                item = _call(c["id"], c["function"]["name"], "", "in_progress")
                out += [self._added(item), *self._arguments(item, c["function"]["arguments"])]
        elif self.calls is not None and not self.call_items:     # cut before a call began
            out += self._text(output.text)
        elif self.calls is None and self.message is None:        # an empty reply: one empty message
            out += self._text("", begin=True)
        status = _status(output)
        for item in self.items:
            item["status"] = status
            at = self._at(item)
            if item["type"] == "message":
                part = item["content"][0]
                out += [self.event("response.output_text.done", **at, content_index=0, text=part["text"],
                                   logprobs=[]),
                        self.event("response.content_part.done", **at, content_index=0, part=part)]
            else:
                out.append(self.event("response.function_call_arguments.done", **at,
                                      arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self.event(kind, response=self.response(status, self.items, output))]


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt, generated = len(output.prompt_token_ids), len(output.token_ids)
    return {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
            "input_tokens_details": {"cached_tokens": output.metrics.get("num_cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
