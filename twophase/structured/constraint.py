"""One request's grammar state, and the engine's compiler that makes them.

A ``Constraint`` follows the tokens the scheduler keeps (``accept``); the masks of a step are
computed from it without changing it (drafted tokens are tried, then rolled back), so a
rejected draft needs no undo and a preempted request keeps its state with its tokens.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from twophase.errors import InvalidSamplingParam, RequestRejected
from twophase.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)


class StructuredOutputsUnavailable(RequestRejected):
    """The grammar engine is not installed, or the model has no tokenizer it can read."""


class Constraint:
    def __init__(self, matcher: Any, words: int):
        self._m = matcher
        self.words = words              # 32-bit words of one token mask

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the request ends ("stop")."""
        return self._m.is_stopped()

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
        consumed = 0
        for j in range(len(drafts) + 1):
            if self._m.is_stopped():
                break
            self._m.unsafe_compute_mask_ptr(out[j].ctypes.data, out[j].nbytes)
            if j == len(drafts) or not self._m.try_consume_tokens([drafts[j]]):
                break
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        return out


class Grammars:
    """Compiles ``StructuredOutputs`` against one model's tokenizer; compiled grammars are
    cached by their text. Thread-safe: the server compiles off the engine's thread."""

    CACHE = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._llt: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, str] = OrderedDict()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._llt is None:
                self._llt = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._llt

    def check(self, spec: StructuredOutputs) -> str:
        """The checked grammar for ``spec``; ``InvalidSamplingParam`` naming what is wrong."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        from llguidance import LLMatcher

        llt = self._ll_tokenizer()
        try:
            grammar = spec.lark_or_json()
        except (ValueError, TypeError) as exc:
            raise InvalidSamplingParam("structured", f"{spec.kind}: {exc}") from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, llt)
        if failed:
            raise InvalidSamplingParam("structured", f"{spec.kind}: {messages[0]}")
        for m in messages:
            log.warning("structured output (%s): %s", spec.kind, m)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, spec: StructuredOutputs, tokens: Sequence[int] = ()) -> Constraint:
        """A fresh state for ``spec``, advanced past ``tokens`` (output already sampled, as
        a decode worker continues a peer's first token)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), self.check(spec), log_level=0)
        if matcher.is_error():
            raise InvalidSamplingParam("structured", f"{spec.kind}: {matcher.get_error()}")
        c = Constraint(matcher, self.words)
        c.accept_all(tokens)
        return c


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of the model's tokenizer: an HF ``tokenizer.json`` as is, the byte
    tokenizer as its 259 symbols."""
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputsUnavailable(
            "structured outputs need llguidance: pip install 'twophase[structured]' "
            "(or pip install llguidance)") from None
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
