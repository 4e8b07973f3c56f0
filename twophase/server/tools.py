"""Tool calls for ``/v1/chat/completions``: what ``tools`` and ``tool_choice`` make of a
request, and the reply's ``tool_calls`` made from the model's text.

``required`` and a named function are constrained (structured outputs): the model writes a
JSON array of ``{"name", "arguments"}`` calls, or the named function's arguments, held to the
tool's ``parameters`` with open objects closed (``closed``), so a finished call's arguments
validate; a reply cut by ``max_tokens`` ends with "length" and its last call as far as it got.
``auto`` is left to the model: where its chat template defines a tool-call format
(Hermes/Qwen's ``<tool_call>`` tags, Mistral's ``[TOOL_CALLS]``, Llama 3's bare JSON) the calls
are read back from the text; otherwise the reply is plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from twophase.server import protocol as P
from twophase.structured import StructuredOutputs

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    """How one chat request treats tools: ``mode`` none / auto / required / named."""

    mode: str
    tools: list[dict] | None = None            # the tools the template renders (OpenAI's shape)
    structured: StructuredOutputs | None = None
    named: str | None = None                   # the function a named choice calls
    names: tuple[str, ...] = ()
    format: str | None = None                  # auto: the template's tool-call format
    marker_id: int | None = None               # the format's marker, where a special token

    @property
    def calls(self) -> bool:
        return self.mode != "none"


def plan(body: P.ChatCompletionRequest, template: str | None) -> ToolPlan:
    """The request's tool plan; ``ApiError`` (400) naming what contradicts."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice not in ("none", "auto"):
            raise P.ApiError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    names = tuple(t.function.name for t in tools)
    if len(set(names)) != len(names):
        raise P.ApiError(400, "tool names must be unique", "tools")
    if choice == "none":
        return ToolPlan("none")
    if body.response_format is not None and body.response_format.type != "text" or body.structured_outputs:
        raise P.ApiError(400, "response_format and tools contradict: the reply is either the "
                              "format or tool calls (set tool_choice to \"none\" to keep the format)",
                         "response_format")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    params = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
    for i, t in enumerate(tools):
        kind = params[t.function.name].get("type", "object")
        if kind != "object":                 # arguments are a JSON object, as OpenAI's are
            raise P.ApiError(400, f"a tool's parameters must describe a JSON object; got type {kind!r}",
                             f"tools.{i}.function.parameters")
    params = {name: closed(schema) for name, schema in params.items()}
    strict = any(t.function.strict for t in tools)
    if isinstance(choice, P.NamedToolChoice):
        name = choice.function.name
        if name not in params:
            raise P.ApiError(400, f"tool_choice names {name!r}, which is not among the tools "
                                  f"({', '.join(names)})", "tool_choice")
        return ToolPlan("named", rendered, _spec(params[name], strict), name, names)
    if choice == "required":
        one = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": one}, "minItems": 1}
        if not body.parallel_tool_calls:
            array["maxItems"] = 1
        return ToolPlan("required", rendered, _spec(array, strict), None, names)
    return ToolPlan("auto", rendered, None, None, names, template_format(template))


_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
        "unevaluatedItems", "unevaluatedProperties")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("prefixItems", "anyOf", "oneOf")
_OPENS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "$ref")


def closed(schema: Any) -> Any:
    """A tool's ``parameters`` with every object that does not say which other keys it takes
    closed (``additionalProperties: false``), as OpenAI's strict function calling requires:
    a model held to an open object can add keys until ``max_tokens`` and never finish its call.
    An object that sets ``additionalProperties`` (``true`` or a schema), ``patternProperties``
    or ``unevaluatedProperties`` keeps what it says; one built with ``allOf`` or ``$ref`` is
    left as it is (closing it would refuse the keys its parts add), and so are ``allOf``'s
    parts. The schema the template shows the model is the tool's own."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = closed(value)
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: closed(s) for name, s in value.items()}
        elif key in _LISTS and isinstance(value, list):
            out[key] = [closed(s) for s in value]
        else:                                    # allOf, enum, const, default, ... as given
            out[key] = value
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and "properties" in out)
    if is_object and not any(k in out for k in _OPENS):
        out["additionalProperties"] = False
    return out


def _spec(schema: dict, strict: bool) -> StructuredOutputs:
    return StructuredOutputs(json=schema, strict=strict, origin="tools")


def template_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model; ``json`` for a template that
    knows nothing of tools (``messages_for`` then asks for a JSON array of calls)."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("tools" in t and "<|eot_id|>" in t):
        return "llama3"
    return "json" if "tools" not in t else "unknown"


def messages_for(template: str | None, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages as the template can read them: a template that knows nothing of tools
    gets the tools described in a system turn, and earlier calls and results as text."""
    t = template or ""
    out = [dict(m) for m in messages]
    if "tool_calls" not in t:
        for m in out:
            if m.get("tool_calls"):
                m["content"] = (m.get("content") or "") + json.dumps(
                    [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m.pop("tool_calls")])
    if tools and "tools" not in t:
        listing = ("You can call these tools; to call them, answer with a JSON array of "
                   '{"name": ..., "arguments": {...}} objects:\n' + json.dumps(tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{listing}"
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def with_marker(p: ToolPlan, text: str, token_ids: list[int]) -> str:
    """The reply's text with its format's marker where the model wrote it as a special token,
    which detokenising drops (Mistral's ``[TOOL_CALLS]``): it comes first in a call."""
    if p.marker_id is not None and p.marker_id in token_ids and "[TOOL_CALLS]" not in text:
        return "[TOOL_CALLS]" + text
    return text


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished reply. Constrained calls keep the arguments'
    text as the model wrote it (as streamed); one cut short by ``max_tokens`` comes back as
    far as it got, as it streams, with ``finish_reason`` "length"."""
    if p.mode in ("named", "required"):
        calls = [call(name, text[start:end]) for name, start, end in CallStream(p, text).spans()]
        return (None if calls else text), calls
    if p.mode == "auto" and p.format not in (None, "unknown"):
        return _parse_auto(p.format or "", text, p.names)
    return text, []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _parse_auto(fmt: str, text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict]]:
    found: list[Any] = []
    rest = text
    if fmt == "hermes":
        found = [_loads(m) for m in _HERMES.findall(text)]
        rest = _HERMES.sub("", text)
    elif fmt == "mistral" and "[TOOL_CALLS]" in text:
        rest, _, payload = text.partition("[TOOL_CALLS]")
        found = _as_list(_loads(payload.strip()))
    elif fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            found, rest = [_loads(body)], ""
    elif fmt == "json":                             # what messages_for asked of the model
        body = text.strip()
        if body[:1] in ("[", "{"):
            found, rest = _as_list(_loads(body)), ""
    calls = [call(c["name"], c.get("arguments", c.get("parameters", {})))
             for c in found if isinstance(c, dict) and c.get("name") in names]
    if not calls:
        return text, []
    return (rest.strip() or None), calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


@dataclass
class CallStream:
    """Streams a constrained reply's tool calls as they grow: each call's ``id``, ``type`` and
    name first, then its arguments text delta by delta (``tool_calls[].index`` in order)."""

    plan: ToolPlan
    text: str = ""
    sent: list[int] = field(default_factory=list)     # argument characters sent, per call

    def feed(self, delta: str) -> list[dict]:
        """The ``tool_calls`` delta entries ``delta`` completes."""
        self.text += delta
        spans = self.spans()
        out = []
        for i, (name, start, end) in enumerate(spans):
            if i == len(self.sent):
                self.sent.append(0)
                head = call(name, "")
                out.append({"index": i, **head})
            args = self.text[start:end]
            if len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, arguments start, arguments end so far) of each call begun in the text."""
        if self.plan.mode == "named":
            return [(self.plan.named or "", 0, len(self.text))]
        spans, pos, decoder = [], 0, json.JSONDecoder()
        head = re.compile(r'[\[,]\{"name":"([A-Za-z0-9_-]+)","arguments":')
        while (m := head.match(self.text, pos)) is not None:
            start = m.end()
            try:
                _, end = decoder.raw_decode(self.text, start)
            except ValueError:                         # still growing
                spans.append((m[1], start, len(self.text)))
                break
            spans.append((m[1], start, end))
            pos = end + 1                               # past the call's closing brace
        return spans


@dataclass
class HeldText:
    """``auto`` streaming: content is sent as it comes until the text may be starting a tool
    call in the template's format; from there it is held and read at the end."""

    format: str
    text: str = ""
    sent: int = 0
    holding: bool = False

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}     # others: a call is the whole reply

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        marker = self.MARKERS.get(self.format)
        if marker is None:                               # llama3, json: a call is the whole reply
            head = self.text.lstrip()
            if not head or head[0] in "{<[":
                self.holding = bool(head)
                return ""
            return self._send(len(self.text))
        if self.format == "mistral" and self.text.lstrip()[:1] in ("[", ""):
            self.holding = bool(self.text.lstrip())      # its marker, dropped as a special token
            return ""
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.holding = True
            return self._send(at)
        # keep back a tail that may be the marker's beginning
        keep = next((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                     if marker.startswith(self.text[-k:])), 0)
        return self._send(len(self.text) - keep)

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def rest(self) -> str:
        """What was held back, when it turned out to hold no call."""
        return self._send(len(self.text))
