"""``POST /v1/completions``: prompts (text or token ids, one or a batch) continued."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class CompletionFormat:
    def __init__(self, server: ServerState, body: P.CompletionRequest, n: int):
        self.server, self.body = server, body
        self.id, self.created = P.new_id("cmpl"), P.now()
        self.chars_sent = [0] * n                # text offset of each choice's next logprob

    def _choice(self, index: int, text: str, reason: str | None, token_ids=(), logprobs=(),
                offset=0) -> dict:
        lp = (P.completion_logprobs(self.server.tokenizer, list(token_ids), list(logprobs), offset)
              if self.body.logprobs is not None else None)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    def _object(self, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, "text_completion", self.created, self.server.model_name,
                          choices, usage)

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return self._object([self._choice(i, o.text, o.finish_reason, o.token_ids, o.logprobs)
                             for i, o in enumerate(outputs)], _usage(outputs))

    def chunk(self, delta: Delta, index: int) -> dict[str, Any]:
        c = self._choice(index, delta.text, None, delta.token_ids, delta.logprobs, self.chars_sent[index])
        self.chars_sent[index] += len(delta.text)
        return self._object([c])

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        return self._object([self._choice(index, "", output.finish_reason)])

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        return self._object([], _usage(outputs))


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    return P.usage(sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs))


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request):
    server = state_of(request)
    P.check_model(body.model, server.model_name)
    params = body.params(server.default_max_tokens)
    prompts = body.prompts()
    return await respond(request, server.loop, prompts, params, body.stream,
                         CompletionFormat(server, body, len(prompts)))
