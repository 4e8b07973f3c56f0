"""``POST /v1/chat/completions``: messages rendered through the model's chat template."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.errors import InvalidSamplingParam
from twophase.server import protocol as P
from twophase.server import tools as T
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class ChatFormat:
    def __init__(self, server: ServerState, body: P.ChatCompletionRequest, tools: T.ToolPlan):
        self.server, self.body, self.tools = server, body, tools
        self.id, self.created = P.new_id("chatcmpl"), P.now()
        self.role_sent = False
        self.calls = T.CallStream(tools) if tools.mode in ("named", "required") else None
        self.held = (T.HeldText(tools.format) if tools.mode == "auto" and tools.format not in (None, "unknown")
                     else None)

    def _logprobs(self, token_ids, logprobs) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return P.chat_logprobs(self.server.tokenizer, list(token_ids), list(logprobs),
                               self.body.top_logprobs or 0)

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, kind, self.created, self.server.model_name, choices, usage)

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = outputs
        content, calls = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return self._object("chat.completion", [{
            "index": 0, "message": message, "logprobs": self._logprobs(output.token_ids, output.logprobs),
            "finish_reason": self._reason(output, bool(calls))}],
            P.usage(len(output.prompt_token_ids), len(output.token_ids)))

    def _reason(self, output: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason

    def chunk(self, delta: Delta, index: int) -> dict[str, Any] | None:
        content: dict[str, Any] = {"content": delta.text}
        if self.calls is not None:
            content = {k: v for k, v in {"tool_calls": self.calls.feed(delta.text)}.items() if v}
        elif self.held is not None:
            content = {"content": self.held.feed(delta.text)}
        if not any(content.values()) and self.role_sent and delta.logprobs is None:
            return None
        if not self.role_sent:
            content["role"] = "assistant"
            self.role_sent = True
        return self._object("chat.completion.chunk", [{
            "index": index, "delta": content,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs), "finish_reason": None}])

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        called = bool(self.calls and self.calls.sent)
        if self.held is not None:                   # auto: the held text, read for calls
            content, calls = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
            rest = self.held.rest() if not calls else None
            delta = {k: v for k, v in {"content": rest, "tool_calls": [
                {"index": i, **c} for i, c in enumerate(calls)]}.items() if v}
            called = bool(calls)
        return self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                       "finish_reason": self._reason(output, called)}])

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        (output,) = outputs
        return self._object("chat.completion.chunk", [], P.usage(
            len(output.prompt_token_ids), len(output.token_ids)))


@router.post("/v1/chat/completions")
async def chat(body: P.ChatCompletionRequest, request: Request):
    server = state_of(request)
    P.check_model(body.model, server.model_name)
    if server.tokenizer is None:
        raise P.ApiError(400, "this model has no tokenizer or chat template: use "
                              "/v1/completions with token ids", "messages")
    params = body.params(server.default_max_tokens)
    template = server.tokenizer.chat_template
    tools = T.plan(body, template)
    if tools.format == "mistral":
        tools.marker_id = server.tokenizer.vocabulary().get("[TOOL_CALLS]")
    if tools.structured is not None:
        try:
            params = dataclasses.replace(params, structured=tools.structured)
        except InvalidSamplingParam as exc:          # min_tokens or stop beside a forced call
            raise P.ApiError(400, f"{exc.name} {exc.message}", exc.name) from None
    messages = T.messages_for(template, [m.for_template() for m in body.messages], tools.tools)
    try:
        prompt = server.tokenizer.apply_chat_template(messages, tools=tools.tools)
    except Exception as exc:            # a template may refuse a conversation (roles' order)
        raise P.ApiError(400, f"the model's chat template refused these messages: {exc}",
                         "messages") from None
    return await respond(request, server.loop, [prompt], params, body.stream, ChatFormat(server, body, tools),
                         body.max_tokens_field())
