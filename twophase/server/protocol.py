"""OpenAI's request and response shapes, and their mapping onto ``SamplingParams``.

Requests are validated strictly: a parameter this server does not implement is refused with a
400 naming it, never silently ignored (a client that asks for ``n = 3`` or ``logit_bias`` must
know it did not get them). Errors use OpenAI's error object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from twophase.core.params import SamplingParams
from twophase.errors import InvalidSamplingParam


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None                  # metadata only

    def sampling(self, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise ApiError(400, f"n = {self.n} is not supported: one choice per request", "n",
                           code="unsupported_parameter")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        kwargs = {k: v for k, v in {
            "max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "logprobs": logprobs,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop}.items() if v is not None}
        try:
            return SamplingParams(**kwargs)
        except InvalidSamplingParam as exc:
            raise ApiError(400, f"{exc.name} {exc.message}", exc.name) from None


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = 16              # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo", code="unsupported_parameter")
        return self.sampling(self.logprobs, default_max_tokens)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = None

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs = true", "top_logprobs")
        return self.sampling((self.top_logprobs or 0) if self.logprobs else None, default_max_tokens)


def check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(400, f"model {name!r} is not served here; this server serves "
                            f"{served!r}", "model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def envelope(cid: str, kind: str, created: int, model: str, choices: list,
             usage: dict | None = None) -> dict[str, Any]:
    """A response or stream chunk: ``kind`` is OpenAI's ``object`` field."""
    out = {"id": cid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int) -> dict[str, Any]:
    """The completions API's logprobs object for these tokens."""
    text = lambda t: tokenizer.decode([t]) if tokenizer else str(t)  # noqa: E731
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp in zip(token_ids, logprobs):
        out["tokens"].append(text(tok))
        out["token_logprobs"].append(lp[tok])
        out["top_logprobs"].append({text(t): v for t, v in lp.items() if t != tok or len(lp) == 1}
                                   | {text(tok): lp[tok]})
        out["text_offset"].append(offset)
        offset += len(out["tokens"][-1])
    return out


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  top: int) -> dict[str, Any]:
    text = lambda t: tokenizer.decode([t]) if tokenizer else str(t)  # noqa: E731
    content = []
    for tok, lp in zip(token_ids, logprobs):
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({"token": text(tok), "logprob": lp[tok], "bytes": list(text(tok).encode()),
                        "top_logprobs": [{"token": text(t), "logprob": v,
                                          "bytes": list(text(t).encode())} for t, v in ranked]})
    return {"content": content}
