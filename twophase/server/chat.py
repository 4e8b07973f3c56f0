"""``POST /v1/chat/completions``: messages rendered through the model's chat template."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.errors import InvalidSamplingParam
from twophase.server import harmony as H
from twophase.server import protocol as P
from twophase.server import tools as T
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class ChatFormat:
    """``n`` choices of one conversation; each streams with its own tool-call state."""

    def __init__(self, server: ServerState, body: P.ChatCompletionRequest, tools: T.ToolPlan):
        self.server, self.body, self.tools = server, body, tools
        self.id, self.created = P.new_id("chatcmpl"), P.now()
        self.role_sent: set[int] = set()
        self.calls: dict[int, T.CallStream] = {}
        self.held: dict[int, T.HeldText] = {}
        # gpt-oss's harmony replies: reasoning, answer and calls read from the markers (not
        # where a call is forced: that reply is the constrained JSON)
        tok = server.tokenizer
        self.harmony = (tok is not None and H.is_harmony(tok.chat_template) and tools.mode in ("none", "auto"))
        self.names = tools.names if tools.mode == "auto" else ()
        self.streams: dict[int, H.HarmonyStream] = {}

    def _harmony(self, output: RequestOutput) -> H.Reply:
        assert self.server.tokenizer is not None
        return H.parse(self.server.tokenizer.decode(list(output.token_ids), skip_special_tokens=False), self.names)

    def _logprobs(self, token_ids, logprobs) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return P.chat_logprobs(self.server.tokenizer, list(token_ids), list(logprobs),
                               self.body.top_logprobs or 0)

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, kind, self.created, self.server.model_name, choices, usage)

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, output in enumerate(outputs):
            if self.harmony:
                reply = self._harmony(output)
                content, calls = reply.content, reply.calls
            else:
                content, calls = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.harmony:
                message["reasoning_content"] = reply.reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(output.token_ids, output.logprobs),
                            "finish_reason": self._reason(output, bool(calls))})
        out = self._object("chat.completion", choices, _usage(outputs))
        if self.body.prompt_logprobs is not None:          # vLLM's: the response's, not a choice's
            out["prompt_logprobs"] = P.prompt_logprobs(
                self.server.tokenizer, outputs[0].prompt_token_ids, outputs[0].prompt_logprobs)
        return out

    def _reason(self, output: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason

    def _stream_state(self, index: int) -> tuple[T.CallStream | None, T.HeldText | None]:
        tools = self.tools
        if index not in self.calls and tools.mode in ("named", "required"):
            self.calls[index] = T.CallStream(tools)
        if index not in self.held and tools.mode == "auto" and tools.format not in (None, "unknown"):
            self.held[index] = T.HeldText(tools.format)
        return self.calls.get(index), self.held.get(index)

    def chunk(self, delta: Delta, index: int) -> dict[str, Any] | None:
        calls, held = self._stream_state(index)
        content: dict[str, Any] = {"content": delta.text}
        if self.harmony:
            if index not in self.streams:
                tok = self.server.tokenizer
                assert tok is not None
                vocab = tok.vocabulary()
                self.streams[index] = H.HarmonyStream(lambda ids: tok.decode(ids, skip_special_tokens=False),
                                                      self.names, frozenset(vocab[m] for m in H.CLOSERS if m in vocab))
            content = self.streams[index].feed(list(delta.token_ids))
        elif calls is not None:
            content = {k: v for k, v in {"tool_calls": calls.feed(delta.text)}.items() if v}
        elif held is not None:
            content = {"content": held.feed(delta.text)}
        if not any(content.values()) and index in self.role_sent and delta.logprobs is None:
            return None
        if index not in self.role_sent:
            content["role"] = "assistant"
            self.role_sent.add(index)
        return self._object("chat.completion.chunk", [{
            "index": index, "delta": content,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs), "finish_reason": None}])

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        calls, held = self._stream_state(index)
        delta: dict[str, Any] = {}
        called = bool(calls and calls.sent)
        if self.harmony:
            called = bool(self.streams.get(index) and self.streams[index].sent_calls)
        elif held is not None:                      # auto: the held text, read for calls
            content, parsed = T.parse(self.tools, T.with_marker(self.tools, output.text, output.token_ids))
            rest = held.rest() if not parsed else None
            delta = {k: v for k, v in {"content": rest, "tool_calls": [
                {"index": i, **c} for i, c in enumerate(parsed)]}.items() if v}
            called = bool(parsed)
        return self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                       "finish_reason": self._reason(output, called)}])

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        return self._object("chat.completion.chunk", [], _usage(outputs))


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """The conversation counts once however many choices share it."""
    return P.usage(len(outputs[0].prompt_token_ids) if outputs else 0,
                   sum(len(o.token_ids) for o in outputs))


@router.post("/v1/chat/completions")
async def chat(body: P.ChatCompletionRequest, request: Request):
    server = state_of(request)
    body.check_choices(server.max_n)
    prompt, params, tools = prepare(server, body)
    return await respond(request, server.loop, [prompt], params, body.stream, ChatFormat(server, body, tools),
                         body.max_tokens_field(), priority=body.priority)


def prepare(server: ServerState, body: P.ChatCompletionRequest) -> tuple[str, SamplingParams, T.ToolPlan]:
    """The request's prompt (its messages through the chat template), sampling parameters and
    tool plan; ``ApiError`` (400) naming what is wrong. ``/v1/responses`` maps onto this."""
    if server.tokenizer is None:
        raise P.ApiError(400, "this model has no tokenizer or chat template: use "
                              "/v1/completions with token ids", "messages")
    lora = server.adapter_of(body.model)
    params = dataclasses.replace(body.params(server.default_max_tokens), lora=lora)
    tools = plan_tools(server, body)
    if tools.structured is not None:
        try:
            params = dataclasses.replace(params, structured=tools.structured)
        except InvalidSamplingParam as exc:          # min_tokens or stop beside a forced call
            raise P.ApiError(400, f"{exc.name} {exc.message}", exc.name) from None
    effort = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}
    return render(server, body, tools, **effort), params, tools


def plan_tools(server: ServerState, body: P.ChatCompletionRequest) -> T.ToolPlan:
    assert server.tokenizer is not None
    tools = T.plan(body, server.tokenizer.chat_template)
    if tools.format == "mistral":
        tools.marker_id = server.tokenizer.vocabulary().get("[TOOL_CALLS]")
    return tools


def render(server: ServerState, body: P.ChatCompletionRequest, tools: T.ToolPlan, **extra: Any) -> str:
    """The messages through the model's chat template (``extra``: the template's own flags)."""
    assert server.tokenizer is not None
    template = server.tokenizer.chat_template
    messages = T.messages_for(template, [m.for_template() for m in body.messages], tools.tools)
    rendered = H.described(tools.tools) if H.is_harmony(template) else tools.tools
    try:
        return server.tokenizer.apply_chat_template(messages, tools=rendered, **extra)
    except Exception as exc:            # a template may refuse a conversation (roles' order)
        raise P.ApiError(400, f"the model's chat template refused these messages: {exc}",
                         "messages") from None
