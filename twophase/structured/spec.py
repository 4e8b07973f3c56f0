"""What a request may ask its output to match, and the ``llguidance`` grammar it compiles to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NoReturn

from twophase.errors import InvalidSamplingParam

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 4096                 # a grammar of more alternatives takes seconds to compile


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (llguidance's Lark
    dialect). ``strict`` refuses a schema keyword the engine cannot enforce instead of ignoring
    it (OpenAI's ``strict``); without it such a keyword is dropped with a warning. ``origin``
    names the request's field it came from, for error messages (``response_format``, ``tools``)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = True
    origin: str = field(default="structured", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            self._refuse(f"needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            self._refuse("choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            self._refuse(f"choice holds {len(self.choice)} strings; at most {MAX_CHOICES}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                self._refuse(f"{name} must be a non-empty string")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    why = "nested too deeply" if isinstance(exc, RecursionError) else exc
                    self._refuse(f"json: not valid JSON ({why})")
            if not isinstance(schema, (dict, bool)):
                self._refuse("json must be a JSON schema (an object)")

    def _refuse(self, message: str) -> NoReturn:
        raise InvalidSamplingParam(self.origin, message)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A hashable text naming this grammar (for the compiled-grammar cache)."""
        value: Any = getattr(self, self.kind)
        try:
            return json.dumps([self.kind, value, self.strict], sort_keys=True, default=list, ensure_ascii=False)
        except (ValueError, TypeError, RecursionError) as exc:
            self._refuse(f"{self.kind}: not JSON-serialisable ({type(exc).__name__})")

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
