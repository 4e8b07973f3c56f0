"""A request's state as it moves waiting → running (→ preempted → waiting) → finished.

Only the scheduler writes it (and the sampler advances its seeded generator); what leaves the
engine is a copy (``core/outputs.py``). Its text lives in output processing, not here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from twophase.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from twophase.core.kv_params import KVTransferParams
    from twophase.structured.constraint import Constraint


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"          # its prompt's K/V are on their way from a peer (kv_transfer.py)
    FORKING = "forking"          # a choice waiting for its parent's prompt (``Request.forks``)
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """Clock readings; metrics (TTFT, TPOT, ITL, E2E) are derived from these alone."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.finished - self.arrival if self.finished is not None else None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: float, prompt: str | None = None, priority: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.priority = priority                                # lower starts first (as vLLM)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)     # prompt + output
        self.num_computed_tokens = 0                            # tokens whose K/V are in the pool
        self.num_cached_tokens = 0                              # prefix-cache hits at admission
        self.num_preemptions = 0
        self.num_draft_tokens = 0                               # speculative tokens proposed
        self.num_accepted_tokens = 0                            # of which the target kept
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.times = RequestTimes(arrival)
        self.kv_transfer: KVTransferParams | None = None         # K/V at, or kept for, a peer
        self.kv_handoff: KVTransferParams | None = None         # blocks kept for a peer at finish
        self.generator: torch.Generator | None = None
        self.constraint: Constraint | None = None                # structured outputs' grammar state
        self.may_hit_prefix = True          # False: every position is computed (mean/cls embeddings)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # each prompt token's log-probabilities by position (the first token has none), where
        # ``params.prompt_logprobs`` asks for them
        self.prompt_logprobs: list[dict[int, float] | None] = [None]
        # ``n`` choices: choice ``index``; the parent (choice 0) holds the others in ``forks``
        # until its prompt is computed, then they take its blocks (``Scheduler._fork``)
        self.index = 0
        self.parent: Request | None = None
        self.forks: list[Request] = []
        # what its cached blocks' hash chain starts from: empty, or what makes its K/V differ
        # from another request's over the same tokens (its adapter)
        self.cache_root = b""

    @property
    def lora(self) -> str | None:
        """The adapter it runs with (``params.lora``)."""
        return self.params.lora

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V still have to be computed (1 for a request in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether a prefill chunk of it must return logits at every position."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def in_decode(self) -> bool:
        return self.num_output_tokens > 0 and self.num_pending_tokens == 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
