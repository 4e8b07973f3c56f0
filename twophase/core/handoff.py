"""The handoff of one request from a prefill engine to a decode engine: what the prefill side
samples, whether a peer goes on, and how the two sides' outputs join (the cluster's frontend runs
these; so do the core's tests). The blocks themselves move through ``core/kv_transfer.py``.
"""

from __future__ import annotations

import dataclasses

from twophase.core.output_processor import hold_back
from twophase.core.outputs import RequestOutput
from twophase.core.sampling_params import SamplingParams


def first_token_params(p: SamplingParams) -> SamplingParams:
    """What the prefill side samples for a request a peer decodes: the first token under one
    engine's rules. EOS is banned while ``min_tokens`` holds, and stop strings count only from
    ``min_tokens`` on. The peer holds back that token's last characters (``hold_back``), so a
    stop string that spans the first token and the next is still found."""
    return dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1),
                               stop=p.stop if p.min_tokens <= 1 else [])


def wants_decode_peer(p: SamplingParams) -> bool:
    """Whether a request has tokens left after the first for a peer to decode (with one token,
    the prefill side finishes it alone: no lease, and its text is flushed whole)."""
    return p.max_tokens > 1


def continues_on_peer(first: RequestOutput) -> bool:
    """Whether the prefill side's output goes on at a peer: it stopped only for its one token
    and kept the prompt's blocks."""
    return first.finish_reason == "length" and bool(first.kv_transfer_params)


def first_text(first: RequestOutput, p: SamplingParams) -> str:
    """The part of the first token's text that streams before the handoff: the rest is the
    peer's to release, or to cut at a stop string."""
    return hold_back(first.text, p.stop)[0]


def joined(first: RequestOutput, rest: RequestOutput, p: SamplingParams) -> RequestOutput:
    """The whole request: the prefill side's first token, then the decode side's output (its
    times from the prefill side's arrival, where both sides read one clock)."""
    times = rest.times
    if first.times is not None and rest.times is not None:
        times = dataclasses.replace(rest.times, arrival=first.times.arrival,
                                    first_scheduled=first.times.first_scheduled,
                                    token_times=first.times.token_times + rest.times.token_times)
    return dataclasses.replace(rest, prompt=first.prompt, token_ids=first.token_ids + rest.token_ids,
                               text=first_text(first, p) + rest.text,
                               logprobs=first.logprobs + rest.logprobs, kv_transfer_params=None,
                               times=times)
