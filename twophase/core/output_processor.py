"""Output processing: the text a step's tokens release, and stop strings.

Runs after the scheduler has applied a step, on the engine's thread, from ``SeqUpdate`` values
alone (it never reads a ``Request``); what it returns are ``Delta`` values another thread may
keep. A stop string ends a request here, so the engine retires it in the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twophase.core.detokenizer import IncrementalDetokenizer
from twophase.core.outputs import (
    Delta,
    LogProbs,
    RequestOutput,
    RequestStats,
    SeqUpdate,
)
from twophase.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from twophase.models.tokenizer import Tokenizer

# retire(request_id, reason) -> the finished request's stats: the engine's, which makes the
# scheduler retire a request that a stop string ended (and re-labels one already finished)
Retire = Callable[[str, str], RequestStats]


def hold_back(text: str, stop: Sequence[str]) -> tuple[str, str]:
    """``text`` split into what may stream now and the tail a stop string may begin in (its
    last ``len(longest) - 1`` characters): streamed text cannot be taken back."""
    split = max(0, len(text) - max((len(x) - 1 for x in stop), default=0))
    return text[:split], text[split:]


@dataclass
class _Stream:
    """One request's output so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    continues_on_peer: bool = False             # a peer decodes on: it releases what is held back
    index: int = 0                              # its choice among its prompt's ``n``
    prompt_logprobs: list[LogProbs | None] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogProbs] = field(default_factory=list)
    text: str = ""                      # released so far
    held: str = ""                      # held back: a stop string may begin here


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, first_token_ids: Sequence[int] = (),
            continues_on_peer: bool = False, index: int = 0) -> None:
        """``first_token_ids``: output another engine sampled and sent (disaggregated serving):
        the text of what follows them is decoded after them, and they are not sent again, but
        their text's last characters are held back here as one engine would have (the sender
        streamed only what ``hold_back`` releases), so a stop string may begin in them.
        ``continues_on_peer``: another engine continues this request, so an incomplete character at the
        end stays held back (that engine releases it whole) instead of flushed as U+FFFD."""
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        first = "".join(detok.push(t) for t in first_token_ids) if detok is not None else ""
        self._streams[request_id] = _Stream(prompt, list(prompt_token_ids), params, detok, continues_on_peer,
                                            index, held=hold_back(first, params.stop)[1])

    def process(self, updates: list[SeqUpdate], retire: Retire) -> list[Delta]:
        return [self._delta(u, retire) for u in updates]

    def finish(self, request_id: str, reason: str, stats: RequestStats) -> RequestOutput | None:
        """End a request's stream from outside a step (an abort): its output so far."""
        s = self._streams.pop(request_id, None)
        if s is None:
            return None
        return RequestOutput.finished(request_id, s.prompt, s.prompt_token_ids, s.token_ids,
                                      s.text, reason, s.logprobs, stats, s.prompt_logprobs, s.index)

    def _delta(self, u: SeqUpdate, retire: Retire) -> Delta:
        """The step's tokens one at a time (a speculative step brings several): text, then stop
        strings, so tokens after the one that completes a stop string are dropped, and
        ``min_tokens`` is counted at the token that completes it."""
        s = self._streams[u.request_id]
        if u.prompt_logprobs is not None:
            s.prompt_logprobs = u.prompt_logprobs
        reason = u.finish_reason
        tokens, logprobs = list(u.new_token_ids), list(u.new_logprobs)
        before = u.num_output_tokens - len(tokens)
        text, hit = "", False
        for i, token in enumerate(tokens):
            final = reason is not None and i == len(tokens) - 1
            new_text = s.detok.push(token) if s.detok else ""
            if final and s.detok is not None and not s.continues_on_peer:
                new_text += s.detok.flush()
            piece, hit = self._release(s, new_text, before + i + 1, final)
            text += piece
            if hit:
                tokens, logprobs = tokens[:i + 1], logprobs[:i + 1]
                break
        s.token_ids += tokens
        s.logprobs += logprobs
        s.text += text
        if hit:
            reason = "stop"
        output = None
        if reason is not None:
            output = self.finish(u.request_id, reason, retire(u.request_id, reason))
        return Delta(u.request_id, tokens, text, logprobs, reason, output,
                     prompt_logprobs=u.prompt_logprobs)

    @staticmethod
    def _release(s: _Stream, new_text: str, num_output_tokens: int,
                 final: bool) -> tuple[str, bool]:
        """The text that may go out now, and whether a stop string ended the request.

        With stop strings, the last ``len(longest) - 1`` characters are held back: a stop string
        may begin in them, and text that has been streamed cannot be taken back."""
        p = s.params
        if not p.stop:
            return new_text, False
        window = s.held + new_text
        if num_output_tokens >= p.min_tokens:
            cut = min((i for i in (window.find(x) for x in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                s.held = ""
                return window[:cut], True
        out, s.held = (window, "") if final else hold_back(window, p.stop)
        return out, False
