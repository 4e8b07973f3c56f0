"""What a step hands out, as values: copied off the engine's state, so another thread (the
server's event loop) may read them while the engine goes on writing its requests.

``SampledTokens`` is the sampler's answer for one request, ``SeqUpdate`` what the scheduler made
of it (the tokens it kept, whether the request finished), ``Delta`` what output processing adds
(the text those tokens released) and, on a request's last delta, its whole ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from twophase.core.request import Request, RequestTimes

LogProbs = dict[int, float]          # token id -> log-probability (the sampled token and top-n)


@dataclass(frozen=True)
class SampledTokens:
    """The tokens the sampler chose for one request this step (one, without speculation)."""

    token_ids: list[int]                     # none for a chunk in the middle of a prompt
    logprobs: list[LogProbs] | None = None   # one dict per token where the request asked
    # prompt_logprobs: (position of the first, one dict per prompt token) this step's chunk gave
    prompt_logprobs: tuple[int, list[LogProbs]] | None = None


@dataclass(frozen=True)
class RequestStats:
    """A finished request's counters and clock readings (a copy: the request is gone after)."""

    times: RequestTimes
    num_cached_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0          # speculative tokens verified for it
    num_accepted_tokens: int = 0       # of which the target kept
    kv_transfer_params: dict[str, Any] | None = None   # blocks kept for a peer (prefill side)

    @classmethod
    def of(cls, req: Request) -> RequestStats:
        t = req.times
        handoff = req.kv_handoff.to_dict() if req.kv_handoff is not None else None
        return cls(dataclasses.replace(t, token_times=list(t.token_times)),
                   req.num_cached_tokens, req.num_preemptions, req.num_draft_tokens,
                   req.num_accepted_tokens, handoff)


@dataclass(frozen=True)
class SeqUpdate:
    """What one step did to one request that got tokens (the scheduler's output per request)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogProbs]
    num_output_tokens: int               # after this step
    finish_reason: str | None            # "stop" or "length", decided by the token rules
    prompt_logprobs: list[LogProbs | None] | None = None   # whole, on a request's first update


@dataclass
class RequestOutput:
    """A finished request, complete: what ``LLM.generate`` returns and a server replies with."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None          # "stop", "length", "abort", "error" or "rejected"
    logprobs: list[LogProbs] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None            # why a rejected request was rejected
    times: RequestTimes | None = None   # raw clock readings behind the metrics
    kv_transfer_params: dict[str, Any] | None = None   # where a decode engine pulls its K/V
    # each prompt token's log-probabilities (None for the first), where the request asked
    prompt_logprobs: list[LogProbs | None] | None = None
    index: int = 0                      # its choice among its prompt's ``n``
    embedding: list[float] | None = None   # a pooling request's vector (core/pooling.py)

    @classmethod
    def finished(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 token_ids: list[int], text: str, reason: str, logprobs: list[LogProbs],
                 stats: RequestStats, prompt_logprobs: list[LogProbs | None] | None = None,
                 index: int = 0) -> RequestOutput:
        t = stats.times
        return cls(request_id, prompt, list(prompt_token_ids), list(token_ids), text, reason,
                   list(logprobs),
                   {"ttft_s": t.ttft, "tpot_s": t.tpot, "itl_s": t.itl, "e2e_s": t.e2e,
                    "num_cached_tokens": stats.num_cached_tokens,
                    "num_preemptions": stats.num_preemptions,
                    "num_draft_tokens": stats.num_draft_tokens,
                    "num_accepted_tokens": stats.num_accepted_tokens},
                   times=t, kv_transfer_params=stats.kv_transfer_params,
                   prompt_logprobs=prompt_logprobs, index=index)

    @classmethod
    def rejected(cls, request_id: str, prompt: str | list[int], why: str) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        ids = [] if isinstance(prompt, str) else list(prompt)
        return cls(request_id, text, ids, [], "", "rejected", error=why)


@dataclass(frozen=True)
class Delta:
    """What one step produced for one request: the streaming unit. Values only."""

    request_id: str
    token_ids: list[int]
    text: str                                   # the text these tokens released
    logprobs: list[LogProbs]                    # one per token where the request asked; else []
    finish_reason: str | None = None
    output: RequestOutput | None = None         # the whole request, on its last delta
    error: str | None = None                    # why it ended with "error" (not its fault)
    prompt_logprobs: list[LogProbs | None] | None = None   # on its first delta, where asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
