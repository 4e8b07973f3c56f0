"""Timing one phase through an engine, one step at a time: a pure-prefill step of ``n`` tokens,
or the pure-decode steps of ``b`` sequences at a context. What ``twophase bench``'s sweeps and
``[backend] name = "auto"`` measure backends with (through the engine, so its per-step work counts).
"""

from __future__ import annotations

import random
import statistics

from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError


def tokens(n: int, salt: int, vocab: int) -> list[int]:
    """``n`` pseudo-random token ids, the same for the same salt; different salts give
    sequences with no common first block, so no sweep prompt is a prefix-cache hit for another
    (an arithmetic sequence repeated itself every ``vocab`` tokens on a small vocabulary)."""
    rng = random.Random(f"{salt}:{n}")
    return [rng.randrange(3, vocab) for _ in range(n)]


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
    step = llm.engine.step_records()[0]
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
    steps = llm.engine.step_records()
    times = [s.duration for s in steps if s.mix == "decode" and s.decode_seqs == batch]
    if not times:
        most = max((s.decode_seqs for s in steps), default=0)
        raise ConfigError("cache.num_blocks", (
            f"the decode sweep at batch {batch}, context {context}, never ran all {batch} sequences "
            f"together (at most {most}): the KV pool ({llm.num_blocks} blocks of "
            f"{llm.config.cache.block_size} tokens) or scheduler.max_num_seqs "
            f"({llm.config.scheduler.max_num_seqs}) is too small for them; raise cache.num_blocks "
            f"(or cache.memory_gb), or lower the batch size"))
    return statistics.median(times[1:] or times)        # the first one warms caches
