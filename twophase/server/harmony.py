"""gpt-oss's reply format (OpenAI's "harmony"), read back into the chat API's fields.

The model answers in messages, each ``<|start|>{role}<|channel|>{channel}[ to={recipient}]
[<|constrain|>{format}]<|message|>{body}`` and ended by ``<|end|>``, ``<|call|>`` (a tool call)
or ``<|return|>`` (the reply's end); the first message's ``<|start|>assistant`` is the prompt's
last words, not the reply's. The ``analysis`` channel is its reasoning (``reasoning_content``, as
vLLM's and llama.cpp's servers return it), ``final`` its answer (``content``), and a
``commentary`` message to ``functions.{name}`` a tool call whose body is the arguments. Its
markers are special tokens, which decoding for ``content`` drops: the reply is read from its
token ids decoded with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from twophase.server import tools as T

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
CLOSERS = ("<|end|>", "<|call|>", "<|return|>")     # what ends a message
_MESSAGE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?(?:<\|channel\|>(?P<header>[^<]*))?(?:<\|constrain\|>[^<]*)?"
    r"<\|message\|>(?P<body>.*?)(?P<close><\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
_RECIPIENT = re.compile(r"\bto=(\S+)")


def is_harmony(template: str | None) -> bool:
    """A chat template that writes harmony's markers (gpt-oss's)."""
    return bool(template) and all(m in template for m in MARKERS)   # type: ignore[operator]


def described(tools: list[dict] | None) -> list[dict] | None:
    """The tools with an empty description where a client sent none (OpenAI's API allows it):
    gpt-oss's template writes every tool's description and fails on a missing one."""
    if not tools:
        return tools
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


@dataclass
class Reply:
    """A harmony reply read into the chat API's fields."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[dict] = field(default_factory=list)


def _kind(role: str | None, header: str | None) -> tuple[str, str | None]:
    """(channel, recipient) of a message from its role and channel headers (a recipient may
    sit in either: ``assistant to=functions.f`` or ``commentary to=functions.f``)."""
    words = f"{role or ''} {header or ''}"
    to = _RECIPIENT.search(words)
    channel = (header or "").split()[0] if (header or "").split() else ""
    return channel, to.group(1) if to else None


def parse(text: str, names: tuple[str, ...] = ()) -> Reply:
    """``text``: the reply decoded with its special tokens. A call to a function not among
    ``names`` (the tools offered) stays text, as the other formats' do."""
    out = Reply()
    reasoning: list[str] = []
    content: list[str] = []
    for m in _MESSAGE.finditer(text):
        channel, to = _kind(m.group("role"), m.group("header"))
        body = m.group("body")
        if to and to.startswith("functions."):
            name = to.removeprefix("functions.")
            if name in names:
                out.calls.append(T.call(name, body.strip() or "{}"))     # the arguments as written
                continue
        (reasoning if channel == "analysis" else content).append(body)
    out.reasoning = "".join(reasoning) or None
    out.content = "".join(content) or None
    return out


class HarmonyStream:
    """One streamed choice: its token ids so far, decoded with their markers, and what of the
    reasoning and the answer was not sent yet (a call goes out once it is closed). The text of
    closed messages is decoded once (a message's closing marker is a special token, so the
    text splits there exactly); each delta decodes the open message's ids only."""

    def __init__(self, decode, names: tuple[str, ...], closers: frozenset[int] = frozenset()):
        self.decode, self.names, self.closers = decode, names, closers
        self.ids: list[int] = []
        self.closed, self.closed_text = 0, ""        # ids up to the last closing marker, decoded
        self.sent_reasoning = self.sent_content = 0
        self.sent_calls = 0

    def feed(self, token_ids: list[int]) -> dict:
        """The delta's fields (``reasoning_content``, ``content``, ``tool_calls``) for these ids."""
        for t in token_ids:
            self.ids.append(t)
            if t in self.closers:
                self.closed_text += self.decode(self.ids[self.closed:])
                self.closed = len(self.ids)
        text = self.closed_text + self.decode(self.ids[self.closed:])
        if text.endswith("\ufffd"):           # a character split across tokens: wait for the rest
            return {}
        reply = parse(_closed_calls_only(text), self.names)
        out: dict = {}
        r, c = reply.reasoning or "", reply.content or ""
        if len(r) > self.sent_reasoning:
            out["reasoning_content"], self.sent_reasoning = r[self.sent_reasoning:], len(r)
        if len(c) > self.sent_content:
            out["content"], self.sent_content = c[self.sent_content:], len(c)
        if len(reply.calls) > self.sent_calls:
            out["tool_calls"] = [{"index": i, **call} for i, call in
                                 enumerate(reply.calls) if i >= self.sent_calls]
            self.sent_calls = len(reply.calls)
        return out


def _closed_calls_only(text: str) -> str:
    """``text`` without a tool call still being written (its arguments go out whole, once its
    ``<|call|>`` came): a message to a recipient after the last closing marker is cut."""
    last = max(text.rfind(m) for m in CLOSERS)
    tail = text[last:] if last >= 0 else text
    return text[:last] if last >= 0 and "to=" in tail else (text if "to=" not in tail else "")
