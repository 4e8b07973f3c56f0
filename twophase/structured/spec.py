"""What a request may ask its output to match, and the ``llguidance`` grammar it compiles to."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twophase.errors import InvalidSamplingParam

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (llguidance's Lark
    dialect). ``strict`` refuses a schema keyword the engine cannot enforce instead of ignoring
    it (OpenAI's ``strict``); without it such a keyword is dropped with a warning."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidSamplingParam("structured", f"needs exactly one of {', '.join(KINDS)}; "
                                       f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidSamplingParam("structured", "choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidSamplingParam("structured", f"{name} must be a non-empty string")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidSamplingParam("structured", f"json: not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidSamplingParam("structured", "json must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A hashable text naming this grammar (for the compiled-grammar cache)."""
        value: Any = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.strict], sort_keys=True, default=list)

    def lark_or_json(self) -> str:
        """The grammar in llguidance's own form (not yet checked: ``Grammars.compile`` does)."""
        from llguidance import LLMatcher

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            # compact JSON, as OpenAI's structured outputs return; lenient drops what it cannot
            # enforce (with a warning) where the request is not strict
            options = {"whitespace_flexible": False, "lenient": not self.strict}
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        assert self.grammar is not None
        return LLMatcher.grammar_from_lark(self.grammar)
