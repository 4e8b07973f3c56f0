"""Phase sweeps, llama-bench style: prefill and decode measured apart, one step at a time.

- prefill of ``n`` tokens (after ``depth`` cached ones, a prefix-cache hit): one prompt per
  round whose new tokens fit the token budget, so the prompt is one pure-prefill step; the step's
  duration is the measurement.
- decode at batch ``b``, context ``c``: ``b`` prompts of ``c`` tokens prefilled first
  (prefill-first policy; from the prefix cache after the first round), then the median of the
  pure-decode steps that carry all ``b``.

Each call measures one round; the caller interleaves rounds across backends, so drift on a
shared machine hits every backend alike, and takes the median and spread over rounds.
"""

from __future__ import annotations

import dataclasses
import random
import statistics

from twophase.config import BenchConfig
from twophase.core.params import SamplingParams
from twophase.errors import ConfigError


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    """``n`` pseudo-random token ids, the same for the same salt; different salts give
    sequences with no common first block, so no sweep prompt is a prefix-cache hit for another
    (an arithmetic sequence repeated itself every ``vocab`` tokens on a small vocabulary)."""
    rng = random.Random(f"{salt}:{n}")
    return [rng.randrange(3, vocab) for _ in range(n)]


def servable(b: BenchConfig, max_model_len: int) -> tuple[BenchConfig, list[str]]:
    """``b`` with the prompt lengths the model's context cannot take (prompt, cached prefix and
    the one token generated) left out, and a note for each; a config with nothing left to
    measure is a ``ConfigError``."""
    fits = [n for n in b.prompt_lens if b.cache_depth + n + 1 <= max_model_len]
    notes = [f"prefill {n}: skipped, {b.cache_depth} cached + {n} + 1 generated tokens exceed the "
             f"context of {max_model_len}" for n in b.prompt_lens if n not in fits]
    if not fits:
        raise ConfigError("bench.prompt_lens", f"no prompt length fits the context of "
                          f"{max_model_len} tokens (after bench.cache_depth = {b.cache_depth})")
    if b.decode_context + b.decode_steps + 2 > max_model_len:
        raise ConfigError("bench.decode_context", f"{b.decode_context} cached + {b.decode_steps} "
                          f"steps exceed the context of {max_model_len} tokens")
    return dataclasses.replace(b, prompt_lens=fits), notes


def prefill_prompt(n: int, depth: int, salt: int, vocab: int) -> list[int]:
    """The prompt of a prefill round: no prefix shared across lengths or rounds."""
    return tokens(depth + n, salt * 131 + n, vocab)


def decode_prompts(batch: int, context: int, vocab: int) -> list[list[int]]:
    """The contexts of a decode round: the same every round (the prefix cache keeps them)."""
    return [tokens(context, 1000 * batch + j, vocab) for j in range(batch)]


def prefill_round(llm, n: int, depth: int, salt: int) -> float:
    """Seconds of one pure-prefill step computing ``n`` tokens after ``depth`` cached ones."""
    vocab = llm.model.arch.vocab_size
    prompt = prefill_prompt(n, depth, salt, vocab)
    if depth:
        llm.generate([prompt[:depth]], SamplingParams(max_tokens=1, ignore_eos=True))
    llm.reset_stats()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    if out.finish_reason == "rejected":
        raise RuntimeError(f"prefill sweep: the {n}-token prompt was rejected: {out.error}")
    step = llm.engine.steps.records[0]
    if step.mix != "prefill" or step.prefill_tokens != n:
        raise RuntimeError(f"prefill sweep: expected one step of {n} new tokens, got "
                           f"{step.prefill_tokens} ({step.mix}); is the token budget below {n}?")
    return step.duration


def decode_round(llm, batch: int, context: int, steps: int, salt: int) -> float:
    """Median seconds of the pure-decode steps that carry all ``batch`` sequences. Every round
    uses the same contexts, so after the first one the prefix cache holds them and a round
    costs its decode steps only (``salt`` is unused: rounds need not differ)."""
    vocab = llm.model.arch.vocab_size
    prompts = decode_prompts(batch, context, vocab)
    llm.reset_stats()
    llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    times = [s.duration for s in llm.engine.steps.records
             if s.mix == "decode" and s.decode_seqs == batch]
    if not times:
        raise RuntimeError(f"decode sweep: no step carried all {batch} sequences")
    return statistics.median(times[1:] or times)        # the first one warms caches


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of a measurement's rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": len(values)}


OUTLIER = 2.0                  # a round this many times off its case's median is flagged


def outliers(values: list[float], factor: float = OUTLIER) -> list[tuple[int, float, float]]:
    """(index, value, median) of each round more than ``factor`` times slower or faster than
    the median of all the rounds (the figure reported; with one round far off, the median of
    the others is no fairer and would flag the good rounds too)."""
    if len(values) < 3:
        return []
    m = statistics.median(values)
    return [(i, v, m) for i, v in enumerate(values) if v > factor * m or v * factor < m]
