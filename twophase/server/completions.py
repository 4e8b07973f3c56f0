"""``POST /v1/completions``: a prompt (text or token ids) continued."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class CompletionFormat:
    def __init__(self, server: ServerState, body: P.CompletionRequest):
        self.server, self.body = server, body
        self.id, self.created = P.new_id("cmpl"), P.now()
        self.chars_sent = 0                      # text offset of the next streamed logprob

    def _choice(self, text: str, reason: str | None, token_ids=(), logprobs=(), offset=0) -> dict:
        lp = (P.completion_logprobs(self.server.tokenizer, list(token_ids), list(logprobs), offset)
              if self.body.logprobs is not None else None)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

    def _object(self, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, "text_completion", self.created, self.server.model_name,
                          choices, usage)

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        return self._object([self._choice(output.text, output.finish_reason, output.token_ids,
                                          output.logprobs)],
                            P.usage(len(output.prompt_token_ids), len(output.token_ids)))

    def chunk(self, delta: Delta) -> dict[str, Any]:
        c = self._choice(delta.text, None, delta.token_ids, delta.logprobs, self.chars_sent)
        self.chars_sent += len(delta.text)
        return self._object([c])

    def final(self, output: RequestOutput) -> list[dict[str, Any]]:
        out = [self._object([self._choice("", output.finish_reason)])]
        if self.body.stream_options and self.body.stream_options.include_usage:
            out.append(self._object([], P.usage(len(output.prompt_token_ids), len(output.token_ids))))
        return out


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request):
    server = state_of(request)
    P.check_model(body.model, server.model_name)
    params = body.params(server.default_max_tokens)
    return await respond(request, server.loop, body.prompt, params, body.stream,
                         CompletionFormat(server, body))
