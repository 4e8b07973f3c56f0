"""OpenAI's request and response shapes, and their mapping onto ``SamplingParams``.

Requests are validated strictly: a parameter this server does not implement is refused with a
400 naming it, never silently ignored (a client that asks for ``logit_bias`` must know it did
not get it). Errors use OpenAI's error object.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from twophase.core.engine import check_text
from twophase.core.sampling_params import SamplingParams
from twophase.errors import InvalidSamplingParam, RequestRejected
from twophase.structured import StructuredOutputs


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Strict: a wrongly typed value ("max_tokens": "4", "stream": "yes") is a 400, never coerced;
# NaN and infinities are refused.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_STOP = 16                      # stop strings per request
MAX_STOP_CHARS = 256               # characters in one (each is searched for after every token)
MAX_MESSAGES = 1024                # chat messages per request
MAX_PROMPTS = 64                   # prompts in one /v1/completions request
MAX_TOOLS = 128                    # tools (and tool calls) in one chat request


def _utf8(text: str) -> str:
    try:
        return check_text(text)
    except RequestRejected as exc:
        raise ValueError(str(exc)) from None


Text = Annotated[str, AfterValidator(_utf8)]
StopText = Annotated[str, AfterValidator(_utf8), Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(BaseModel):
    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Common(BaseModel):
    model_config = STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 64 - 1)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # beyond OpenAI's API, as vLLM accepts them
    top_k: int | None = None                 # 0 or -1 (vLLM's spelling): off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None   # vLLM's: the prompt's own
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None   # vLLM's: tenants apart
    user: str | None = None                  # metadata only
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None     # vLLM's: json, regex, choice, grammar
    priority: int = 0                        # vLLM's: the lower value is served first

    def structured(self) -> StructuredOutputs | None:
        """What the output must match (``response_format`` or vLLM's ``structured_outputs``)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ApiError(400, "give response_format or structured_outputs, not both", "response_format")
        try:
            if so is not None:
                return StructuredOutputs(**so.model_dump(exclude_none=True, by_alias=True), origin="structured_outputs")
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputs(json_object=True, origin="response_format")
            if rf.json_schema is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema",
                               "response_format.json_schema")
            if rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format.json_schema needs a schema",
                               "response_format.json_schema.schema")
            return StructuredOutputs(json=rf.json_schema.schema_, strict=bool(rf.json_schema.strict),
                                     origin="response_format.json_schema.schema")
        except InvalidSamplingParam as exc:
            raise ApiError(400, exc.message, exc.name) from None

    def max_tokens_field(self) -> str:
        """The name the client gave its length limit (the engine's messages say ``max_tokens``)."""
        return "max_tokens"

    def check_choices(self, max_n: int) -> None:
        """``n`` within the server's limit (``server.max_n``): each choice is a request."""
        if self.n > max_n:
            raise ApiError(400, f"n = {self.n} exceeds this server's limit of {max_n} choices "
                                f"(server.max_n)", "n")

    def sampling(self, logprobs: int | None, default_max_tokens: int,
                 max_tokens_field: str = "max_tokens", n: int | None = None,
                 prompt_logprobs: int | None = None, max_tokens: int | None = None) -> SamplingParams:
        """``n``, ``prompt_logprobs``, ``max_tokens``: where the endpoint asks the engine for
        other than the client did (``best_of``, ``echo``)."""
        if max_tokens is None and self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, f"{max_tokens_field} must be at least 1, got {self.max_tokens}",
                           max_tokens_field)
        kwargs = {k: v for k, v in {
            "cache_salt": self.cache_salt, "n": n or self.n,
            "prompt_logprobs": _most(prompt_logprobs, self.prompt_logprobs),
            "max_tokens": max_tokens or self.max_tokens or default_max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "logprobs": logprobs,
            "top_k": 0 if self.top_k == -1 else self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens, "structured": self.structured(),
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop}.items() if v is not None}
        try:
            return SamplingParams(**kwargs)
        except InvalidSamplingParam as exc:
            raise ApiError(400, f"{exc.name} {exc.message}", exc.name) from None


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


Prompt = Text | Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Common):
    # one prompt (text or token ids), or a batch of them: one choice each, in order
    prompt: Prompt | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False                           # the prompt (and its logprobs) before each choice
    best_of: Annotated[int, Field(ge=1)] | None = None    # run this many, return the n likeliest

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def candidates(self) -> int:
        """Choices run a prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens = 0``: the prompt scored, nothing generated (one token is
        sampled and dropped)."""
        return self.echo and self.max_tokens == 0

    def check_choices(self, max_n: int) -> None:
        super().check_choices(max_n)
        if self.best_of is None:
            return
        if self.best_of > max_n:
            raise ApiError(400, f"best_of = {self.best_of} exceeds this server's limit of {max_n} "
                                f"choices (server.max_n)", "best_of")
        if self.best_of < self.n:
            raise ApiError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and self.best_of > self.n:
            raise ApiError(400, "best_of > n cannot be streamed: the best are known only at the "
                                "end", "best_of")

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo, to score the "
                                "prompt)", "max_tokens")
        ranked = self.candidates > self.n               # ranking needs each token's logprob
        logprobs = 0 if ranked and self.logprobs is None else self.logprobs
        return self.sampling(logprobs, default_max_tokens, n=self.candidates,
                             prompt_logprobs=self.logprobs if self.echo else None,
                             max_tokens=1 if self.echo_only else None)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: Text
    arguments: Text                              # a JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT
    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None
    # an earlier reply's reasoning, sent back as this server returned it (``reasoning`` is the
    # name other servers use)
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or thought)):
            raise ValueError("content is required (only an assistant message with tool_calls or "
                             "reasoning_content may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for field in ("reasoning_content", "reasoning"):
            if getattr(self, field) is not None and self.role != "assistant":
                raise ValueError(f"only assistant messages carry {field}")
        if None not in (self.reasoning_content, self.reasoning) and self.reasoning_content != self.reasoning:
            raise ValueError("reasoning_content and reasoning differ: send one of them")
        return self

    def for_template(self) -> dict[str, Any]:
        """What a chat template reads: text content, ``developer`` as ``system`` (OpenAI's
        newer name for the same role; templates know the older one), tool calls with their
        arguments as objects (templates write them with ``tojson``), and an earlier reply's
        reasoning as ``reasoning_content`` (Qwen3's templates) and ``thinking`` (gpt-oss's,
        which keeps it before a call, and refuses a call that has both a thinking and a
        content: there the content, the preamble the model wrote, is what it keeps)."""
        text = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content or self.reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
            if not (self.tool_calls and text):
                out["thinking"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: ToolName


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: int | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # how much a reasoning model thinks, where its chat template reads it (gpt-oss's does)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def max_tokens_field(self) -> str:
        # OpenAI's newer name for max_tokens; where both are sent, it wins
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs = true", "top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs are returned with the whole response: not with "
                                "stream = true", "prompt_logprobs")
        return self.sampling((self.top_logprobs or 0) if self.logprobs else None, default_max_tokens,
                             self.max_tokens_field())


def check_model(name: str, served: str, adapters: Collection[str] = ()) -> str | None:
    """The adapter ``name`` names (None: the base model); a 404 for anything else."""
    if name == served:
        return None
    if name in adapters:
        return name
    also = f" and the adapters {', '.join(sorted(adapters))}" if adapters else ""
    raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                        f"{served!r}{also}", "model", type_="not_found_error", code="model_not_found")


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


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        offset: int) -> dict[str, Any]:
    """The completions API's logprobs object for these tokens (an echoed prompt's first token
    has none: null, as OpenAI returns it)."""
    text = lambda t: tokenizer.decode([t]) if tokenizer else str(t)  # noqa: E731
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp in zip(token_ids, logprobs):
        out["tokens"].append(text(tok))
        out["token_logprobs"].append(None if lp is None else lp[tok])
        out["top_logprobs"].append(None if lp is None else {
            text(t): v for t, v in lp.items() if t != tok or len(lp) == 1} | {text(tok): lp[tok]})
        out["text_offset"].append(offset)
        offset += len(out["tokens"][-1])
    return out


def prompt_logprobs(tokenizer, token_ids: list[int],
                    logprobs: list[dict[int, float] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: for each prompt token (None for the first), the token's own
    and the top alternatives, keyed by token id."""
    if logprobs is None:
        return None
    text = lambda t: tokenizer.decode([t]) if tokenizer else str(t)  # noqa: E731
    return [None if lp is None else {str(t): {"logprob": v, "decoded_token": text(t)}
                                     for t, v in lp.items()} for lp in logprobs[:len(token_ids)]]


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
