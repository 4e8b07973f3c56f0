"""``SamplingParams``: what a request asks of the sampler and of its stopping rules."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from twophase.errors import InvalidSamplingParam
from twophase.structured.spec import StructuredOutputs


@dataclass
class SamplingParams:
    """Checked when made (``InvalidSamplingParam``, naming the field): every float finite;
    ``temperature`` in [0, 2], ``top_p`` in (0, 1], ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (OpenAI's ranges); ``min_p`` in [0, 1] and
    ``repetition_penalty`` > 0 (vLLM's).

    ``n`` choices of one prompt: its prompt is computed once and its blocks shared; choice ``i``
    samples with ``seed + i`` (vLLM's rule), so it equals the prompt sent alone with that seed.
    ``prompt_logprobs``: each prompt token's log-probability given the tokens before it (the
    first has none), computed in the prefill that runs anyway; such a prompt never skips its
    cached prefix, whose logits it needs."""

    max_tokens: int = 64
    min_tokens: int = 0                  # EOS and stop tokens are suppressed before this many
    temperature: float = 0.0             # 0: greedy
    top_k: int = 0                       # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None              # per-request generator: same seed, same tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # top-n log-probabilities of each sampled token
    prompt_logprobs: int | None = None   # top-n log-probabilities of each prompt token (vLLM's)
    n: int = 1                           # choices: the prompt computed once, its blocks shared
    lora: str | None = None              # the adapter to run with, by name (None: the base model)
    # requests share cached prefixes only with requests of the same salt (vLLM's): tenants apart
    cache_salt: str | None = None
    structured: StructuredOutputs | None = None   # a schema, regex, choice or grammar to match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for f in fields(self):
            check, kind = _KINDS[f.name]
            if not check(getattr(self, f.name)):
                raise InvalidSamplingParam(f.name, f"must be {kind}, got {getattr(self, f.name)!r}")
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (self.temperature <= 2, "temperature", "must be in [0, 2] (0: greedy)"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be in [0, 20]"),
            (self.n >= 1, "n", "must be at least 1"),
            (self.seed is None or -(2 ** 63) <= self.seed < 2 ** 64, "seed",
             "must fit in 64 bits: [-2**63, 2**64)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (self.structured is None or self.min_tokens == 0, "min_tokens",
             "cannot be combined with structured outputs (the grammar decides where the output ends)"),
            (self.structured is None or not self.stop, "stop",
             "cannot be combined with structured outputs (a stop string would cut the answer short)"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise InvalidSamplingParam(name, f"{msg}, got {getattr(self, name)!r}")

    def choice(self, i: int) -> SamplingParams:
        """What choice ``i`` samples with, alone: ``n = 1`` and ``seed + i`` (past 2**64 - 1 it
        wraps around, as a 64-bit generator's seed would)."""
        seed = self.seed
        if seed is not None:
            seed = seed + i - 2 ** 64 if seed + i >= 2 ** 64 else seed + i
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidSamplingParam(name, f"is not a sampling parameter; allowed: "
                                             f"{', '.join(sorted(names))}")
        return cls(**d)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: object) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:                # an int past any float
        return False


_KINDS = {
    "max_tokens": (_int, "an integer"), "min_tokens": (_int, "an integer"),
    "temperature": (_num, "a finite number"), "top_k": (_int, "an integer"),
    "top_p": (_num, "a finite number"), "min_p": (_num, "a finite number"),
    "repetition_penalty": (_num, "a finite number"),
    "presence_penalty": (_num, "a finite number"), "frequency_penalty": (_num, "a finite number"),
    "seed": (lambda v: v is None or _int(v), "an integer or None"),
    "stop": (lambda v: isinstance(v, list), "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_int(t) and t >= 0 for t in v),
                       "a list of non-negative token ids"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "logprobs": (lambda v: v is None or _int(v), "an integer or None"),
    "prompt_logprobs": (lambda v: v is None or _int(v), "an integer or None"),
    "n": (_int, "an integer"),
    "cache_salt": (lambda v: v is None or isinstance(v, str), "a string or None"),
    "lora": (lambda v: v is None or (isinstance(v, str) and bool(v)), "an adapter's name or None"),
    "structured": (lambda v: v is None or isinstance(v, StructuredOutputs), "a StructuredOutputs or None"),
}
