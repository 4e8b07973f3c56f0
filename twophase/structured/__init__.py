"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar.

``llguidance`` does the grammar work (compiling a schema, the set of tokens allowed next, a
mask in tens of microseconds a token, rollback); this package is the seam between it and the
engine: what a request asks for (``spec``), one request's live grammar state (``constraint``)
and a step's masks, computed while the forward pass runs (``masks``).
"""

from twophase.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
