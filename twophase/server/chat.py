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

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        message = {"role": "assistant", "content": output.text}
        return self._object("chat.completion", [{
            "index": 0, "message": message, "logprobs": self._logprobs(output.token_ids, output.logprobs),
            "finish_reason": output.finish_reason}],
            P.usage(len(output.prompt_token_ids), len(output.token_ids)))

    def chunk(self, delta: Delta) -> dict[str, Any]:
        content: dict[str, Any] = {"content": delta.text}
        if not self.role_sent:
            content["role"] = "assistant"
            self.role_sent = True
        return self._object("chat.completion.chunk", [{
            "index": 0, "delta": content, "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
            "finish_reason": None}])

    def final(self, output: RequestOutput) -> list[dict[str, Any]]:
        out = [self._object("chat.completion.chunk", [{"index": 0, "delta": {}, "logprobs": None,
                                                        "finish_reason": output.finish_reason}])]
        if self.body.stream_options and self.body.stream_options.include_usage:
            out.append(self._object("chat.completion.chunk", [], P.usage(
                len(output.prompt_token_ids), len(output.token_ids))))
        return out


@router.post("/v1/chat/completions")
async def chat(body: P.ChatCompletionRequest, request: Request):
    server = state_of(request)
    P.check_model(body.model, server.model_name)
    if server.tokenizer is None:
        raise P.ApiError(400, "this model has no tokenizer or chat template: use "
                              "/v1/completions with token ids", "messages")
    params = body.params(server.default_max_tokens)
    prompt = server.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages])
    return await respond(request, server.loop, prompt, params, body.stream, ChatFormat(server, body))
