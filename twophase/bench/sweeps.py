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
import statistics

from twophase.config import BenchConfig
from twophase.errors import ConfigError
from twophase.measure.phase_timing import decode_prompts, decode_round, prefill_prompt, prefill_round, tokens

__all__ = ["decode_prompts", "decode_round", "outliers", "prefill_prompt", "prefill_round", "servable",
           "spread", "tokens"]


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
