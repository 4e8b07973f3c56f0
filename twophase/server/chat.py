"""``POST /v1/chat/completions``: messages rendered through the model's chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class ChatFormat:
    def __init__(self, server: ServerState, body: P.ChatCompletionRequest):
        self.server, self.body = server, body
        self.id, self.created = P.new_id("chatcmpl"), P.now()
        self.role_sent = False

    def _logprobs(self, token_ids, logprobs) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return P.chat_logprobs(self.server.tokenizer, list(token_ids), list(logprobs),
                               self.body.top_logprobs or 0)

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, kind, self.created, self.server.model_name, choices, usage)

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = outputs
        message = {"role": "assistant", "content": output.text}
        return self._object("chat.completion", [{
            "index": 0, "message": message, "logprobs": self._logprobs(output.token_ids, output.logprobs),
            "finish_reason": output.finish_reason}],
            P.usage(len(output.prompt_token_ids), len(output.token_ids)))

    def chunk(self, delta: Delta, index: int) -> dict[str, Any]:
        content: dict[str, Any] = {"content": delta.text}
        if not self.role_sent:
            content["role"] = "assistant"
            self.role_sent = True
        return self._object("chat.completion.chunk", [{
            "index": index, "delta": content,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs), "finish_reason": None}])

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        return self._object("chat.completion.chunk", [{"index": index, "delta": {}, "logprobs": None,
                                                       "finish_reason": output.finish_reason}])

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
    try:
        prompt = server.tokenizer.apply_chat_template([m.for_template() for m in body.messages])
    except Exception as exc:            # a template may refuse a conversation (roles' order)
        raise P.ApiError(400, f"the model's chat template refused these messages: {exc}",
                         "messages") from None
    return await respond(request, server.loop, [prompt], params, body.stream, ChatFormat(server, body))
