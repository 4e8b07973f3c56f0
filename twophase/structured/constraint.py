"""One request's grammar state, and the engine's compiler that makes them.

A ``Constraint`` follows the tokens the scheduler keeps (``accept``); the masks of a step are
computed from it without changing it (drafted tokens are tried, then rolled back), so a
rejected draft needs no undo and a preempted request keeps its state with its tokens.

Grammars are held to limits that keep every step fast: llguidance's parser limits, a first
mask timed at compile time (a grammar slow from its first token is refused), and a request
whose mask later takes too long ends with an error instead of holding up the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from twophase.errors import InvalidSamplingParam, RequestRejected
from twophase.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)

FIRST_MASK_LIMIT_S = 0.1       # a grammar whose first mask takes longer is refused at compile
STEP_MASK_LIMIT_S = 0.25       # a request whose mask takes longer ends with an error
CACHE_ENTRIES = 64
CACHE_BYTES = 32 << 20         # compiled grammars kept, by the size of their text


def parser_limits() -> Any:
    """llguidance's limits, tighter than its defaults where a request could otherwise make one
    step cost seconds (lexer states, a step's fuel); errors without the parser's state (which
    would echo the schema into logs and replies)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_lexer_states=50_000, initial_lexer_fuel=500_000,
                          step_lexer_fuel=100_000, max_grammar_size=200_000, verbose_errors=False)


def rejected(exc: InvalidSamplingParam) -> RequestRejected:
    """A grammar's refusal as a request's: the message, and the field at fault."""
    out = RequestRejected(f"{exc.name}: {exc.message}")
    out.param = exc.name
    return out


class StructuredOutputsUnavailable(RequestRejected):
    """The grammar engine is not installed, or the model has no tokenizer it can read."""


class Constraint:
    def __init__(self, matcher: Any, words: int):
        self._m = matcher
        self.words = words              # 32-bit words of one token mask
        self.failed: str | None = None  # why the grammar can no longer be followed

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the request ends ("stop")."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the request must end with an error (the grammar broke, or grew too slow)."""
        if self.failed is None and self._m.is_error():
            self.failed = self._m.get_error() or "the grammar failed"
        return self.failed

    def accept(self, token: int) -> bool:
        """Advance past a kept token; False (and an error state) if the grammar forbids it."""
        ok = self._m.consume_token(token)
        if not ok:
            log.warning("a token the grammar forbids was kept: %s", self._m.get_error())
        return ok

    def accept_all(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.accept(int(t))

    def masks(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """``[1 + len(drafts), words]`` int32 bitmasks: the tokens allowed next, then after each
        draft in turn (all allowed past a draft the grammar refuses: verification stops at it
        anyway). The state is left as it was."""
        out = np.full((1 + len(drafts), self.words), -1, dtype=np.int32)
        consumed, t0 = 0, time.perf_counter()
        for j in range(len(drafts) + 1):
            if self._m.is_stopped():
                break
            self._m.unsafe_compute_mask_ptr(out[j].ctypes.data, out[j].nbytes)
            if j == len(drafts) or not self._m.try_consume_tokens([drafts[j]]):
                break
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        spent = time.perf_counter() - t0
        if spent > STEP_MASK_LIMIT_S * (1 + len(drafts)) and self.failed is None:
            self.failed = (f"the grammar is too slow to follow: a step's mask took {spent * 1e3:.0f} ms "
                           f"(the limit is {STEP_MASK_LIMIT_S * 1e3:.0f} ms a token)")
        return out


class Grammars:
    """Compiles ``StructuredOutputs`` against one model's tokenizer; compiled grammars (a fresh
    matcher each, copied for every request) are cached by their text. Thread-safe: the server
    compiles off the engine's thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._llt: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()     # key -> a matcher at its start
        self._cache_bytes = 0

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._llt is None:
                self._llt = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._llt

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` (cached); ``InvalidSamplingParam`` naming what is wrong."""
        self._compiled(spec)

    def constraint(self, spec: StructuredOutputs, tokens: Sequence[int] = ()) -> Constraint:
        """A fresh state for ``spec``, advanced past ``tokens`` (output already sampled, as
        a decode worker continues a peer's first token)."""
        c = Constraint(self._compiled(spec).deep_copy(), self.words)
        c.accept_all(tokens)
        return c

    def _compiled(self, spec: StructuredOutputs) -> Any:
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        matcher = self._compile(spec)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = matcher
                self._cache_bytes += len(key)
            while len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES:
                old, _ = self._cache.popitem(last=False)
                self._cache_bytes -= len(old)
        return matcher

    def _compile(self, spec: StructuredOutputs) -> Any:
        llt = self._ll_tokenizer()               # first: says what to install where it is missing
        from llguidance import LLMatcher

        def refuse(message: str) -> NoReturn:
            raise InvalidSamplingParam(spec.origin, f"{spec.kind}: {message}")

        try:
            grammar = spec.lark_or_json()
        except (ValueError, TypeError, RecursionError) as exc:
            refuse(str(exc) or type(exc).__name__)
        limits = parser_limits()
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=limits)
        if failed:
            refuse(messages[0])
        for m in messages:
            log.warning("structured output (%s): %s", spec.kind, m)
        matcher = LLMatcher(llt, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            refuse(matcher.get_error())
        self._first_step(matcher.deep_copy(), refuse)
        return matcher

    def _first_step(self, m: Any, refuse: Callable[[str], NoReturn]) -> None:
        """Refuse a grammar that admits no output at all, or whose first mask is already slow."""
        mask = np.zeros(self.words, dtype=np.int32)
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        spent = time.perf_counter() - t0
        if spent > FIRST_MASK_LIMIT_S:
            refuse(f"too complex to decode at speed: its first step's mask took {spent * 1e3:.0f} ms "
                   f"(the limit is {FIRST_MASK_LIMIT_S * 1e3:.0f} ms)")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if m.is_error() or (not m.is_accepting() and set(allowed.tolist()) <= set(self.eos_token_ids)):
            refuse("the grammar admits no output (" + (m.get_error() or "nothing can be generated")
                   .split("\n")[0] + ")")


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of the model's tokenizer: an HF ``tokenizer.json`` as is, the byte
    tokenizer as its 259 symbols."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputsUnavailable(
            "structured outputs need llguidance: pip install llguidance") from None
    if tokenizer is None:
        raise StructuredOutputsUnavailable("structured outputs need the model's tokenizer; this "
                                           "model has none")
    eos = eos_token_ids or None
    to_str = getattr(tokenizer, "to_json", None)
    if to_str is not None:
        return llguidance.LLTokenizer(to_str(), n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(_ByteVocabulary(tokenizer, vocab_size, eos_token_ids).wrapper,
                                  n_vocab=vocab_size, eos_token=eos)


class _ByteVocabulary:
    """The byte tokenizer in the shape ``llguidance.TokenizerWrapper`` reads."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        import llguidance

        vocab = tokenizer.vocabulary()
        by_id = {i: s for s, i in vocab.items()}
        offset = tokenizer.OFFSET
        self.tokens = [bytes([i - offset]) if offset <= i < 256 + offset else by_id.get(i, "").encode()
                       for i in range(vocab_size)]
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 2
        self.bos_token_id = 1
        self.special_token_ids = [i for i in range(vocab_size) if not offset <= i < 256 + offset]
        self._tok = tokenizer
        self.wrapper = llguidance.TokenizerWrapper(self)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            return [b + self._tok.OFFSET for b in text]
        return self._tok.encode(text)
