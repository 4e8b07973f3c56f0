"""``POST /v1/completions``: prompts (text or token ids, one or a batch) continued, ``n``
choices each (``best_of`` run, the likeliest ``n`` kept), the prompt echoed where asked."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from twophase.core.outputs import Delta, RequestOutput
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import respond

router = APIRouter()


class CompletionFormat:
    """Choices in order: prompt ``p``'s ``i``-th is choice ``p * n + i``. Handles come
    ``candidates`` a prompt (``best_of`` or ``n``); where ``best_of > n`` only the ``n`` with the
    highest summed log-probability are returned (never streamed)."""

    def __init__(self, server: ServerState, body: P.CompletionRequest, prompts: list[str | list[int]]):
        self.server, self.body, self.prompts = server, body, prompts
        self.id, self.created = P.new_id("cmpl"), P.now()
        self.k = body.candidates
        self.chars_sent = [0] * (len(prompts) * self.k)   # text offset of a choice's next logprob
        self.started: set[int] = set()

    def _prompt(self, p: int, output_or_ids: RequestOutput | None = None) -> tuple[str, list[int]]:
        """Prompt ``p``'s text and token ids (what ``echo`` returns)."""
        prompt, tok = self.prompts[p], self.server.tokenizer
        if output_or_ids is not None:
            ids = output_or_ids.prompt_token_ids
        else:
            ids = prompt if isinstance(prompt, list) else tok.encode(prompt) if tok else []
        if isinstance(prompt, str):
            return prompt, list(ids)
        return (tok.decode(ids) if tok else ""), list(ids)

    def _choice(self, index: int, text: str, reason: str | None, token_ids=(), logprobs=(),
                offset=0, echo: tuple[str, list[int], list | None] | None = None) -> dict:
        """``echo``: the prompt's text, ids and log-probabilities, before the choice's own."""
        lp = None
        if self.body.logprobs is not None:
            lp = P.completion_logprobs(self.server.tokenizer, list(token_ids), list(logprobs), offset)
            if echo is not None and self.body.echo:
                head = P.completion_logprobs(self.server.tokenizer, echo[1], list(echo[2] or []), 0)
                lp = {k: head[k] + [o + len(echo[0]) for o in lp[k]] if k == "text_offset"
                      else head[k] + lp[k] for k in lp}
        out = {"index": index, "text": (echo[0] if echo else "") + text, "logprobs": lp,
               "finish_reason": reason}
        if self.body.prompt_logprobs is not None and echo is not None:    # vLLM's field
            out["prompt_logprobs"] = P.prompt_logprobs(self.server.tokenizer, echo[1], echo[2])
        return out

    def _object(self, choices: list, usage: dict | None = None) -> dict[str, Any]:
        return P.envelope(self.id, "text_completion", self.created, self.server.model_name,
                          choices, usage)

    def _kept(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Each prompt's ``n`` choices: where ``best_of`` ran more, the likeliest."""
        n, kept = self.body.n, []
        for p in range(0, len(outputs), self.k):
            group = outputs[p:p + self.k]
            if self.k > n:
                group = sorted(group, key=_summed_logprob, reverse=True)[:n]
            kept += group
        return kept

    def whole(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body, choices = self.body, []
        for i, o in enumerate(self._kept(outputs)):
            echo = None
            if body.echo or body.prompt_logprobs is not None:
                text, ids = self._prompt(i // body.n, o)
                echo = (text if body.echo else "", ids, o.prompt_logprobs)
            mine = (o.text, o.token_ids, o.logprobs) if not body.echo_only else ("", [], [])
            choices.append(self._choice(i, mine[0], o.finish_reason, mine[1], mine[2],
                                        echo=echo))
        return self._object(choices, self._usage(outputs))

    def chunk(self, delta: Delta, index: int) -> dict[str, Any]:
        body, echo = self.body, None
        if index not in self.started:                       # the choice's first chunk
            self.started.add(index)
            if body.echo or body.prompt_logprobs is not None:
                text, ids = self._prompt(index // body.n)
                echo = (text if body.echo else "", ids, delta.prompt_logprobs)
                self.chars_sent[index] += len(echo[0])
        mine = (delta.text, delta.token_ids, delta.logprobs) if not body.echo_only else ("", [], [])
        c = self._choice(index, mine[0], None, mine[1], mine[2], self.chars_sent[index], echo)
        self.chars_sent[index] += len(mine[0])
        return self._object([c])

    def finish(self, output: RequestOutput, index: int) -> dict[str, Any]:
        return self._object([self._choice(index, "", output.finish_reason)])

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        return self._object([], self._usage(outputs))

    def _usage(self, outputs: list[RequestOutput]) -> dict[str, int]:
        """A prompt counts once however many choices share it; every token generated counts
        (``best_of``'s dropped choices too: they were computed)."""
        generated = 0 if self.body.echo_only else sum(len(o.token_ids) for o in outputs)
        return P.usage(sum(len(o.prompt_token_ids) for o in outputs[::self.k]), generated)


def _summed_logprob(output: RequestOutput) -> float:
    return sum(lp[t] for t, lp in zip(output.token_ids, output.logprobs))


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request):
    server = state_of(request)
    lora = server.adapter_of(body.model)
    body.check_choices(server.max_n)
    params = dataclasses.replace(body.params(server.default_max_tokens), lora=lora)
    prompts = body.prompts()
    return await respond(request, server.loop, prompts, params, body.stream,
                         CompletionFormat(server, body, prompts), priority=body.priority)
