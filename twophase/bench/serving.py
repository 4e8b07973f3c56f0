"""A serving workload: requests arriving over time (Poisson at a given rate, or all at once),
driven through an engine's incremental API, and the latency figures of vLLM's serving benchmark
(TTFT, TPOT, ITL, E2E with mean, p50, p90, p99) computed from the requests' clock readings.

A request's arrival is its *scheduled* time, not the moment the loop got round to adding it:
when the engine is busy in a step, later arrivals wait in the queue and that wait counts.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twophase.core.metrics import speculative_summary, summarize
from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError


@dataclass
class TimedRequest:
    offset_s: float              # arrival, seconds after the start
    prompt: list[int] | str
    max_tokens: int


def synthetic(n: int, rate: float | None, input_len: list[int], output_len: list[int],
              vocab_size: int, seed: int = 0) -> list[TimedRequest]:
    """``n`` requests of uniform random lengths; exponential gaps at ``rate`` requests/s
    (a Poisson process), or all at time 0 when ``rate`` is None."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_len))]
        out.append(TimedRequest(t, prompt, rng.randint(*output_len)))
        if rate:
            t += rng.expovariate(rate)
    return out


def trace(path: Path, rate: float | None, default_max_tokens: int, seed: int = 0) -> list[TimedRequest]:
    """A JSONL trace: one ``{"prompt" | "prompt_token_ids", "max_tokens"?, "arrival_s"?}`` a
    line; without ``arrival_s``, arrivals follow ``rate`` as for synthetic requests."""
    rng = random.Random(seed)
    out, t = [], 0.0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError("bench.serving.jsonl", f"cannot read {path}: {exc.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt_token_ids"] if "prompt_token_ids" in row else row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError("bench.serving.jsonl", f"{path}:{i}: expected a JSON object with "
                              f"\"prompt\" or \"prompt_token_ids\"") from None
        if "arrival_s" in row:
            t = float(row["arrival_s"])
        out.append(TimedRequest(t, prompt, int(row.get("max_tokens", default_max_tokens))))
        if rate and "arrival_s" not in row:
            t += rng.expovariate(rate)
    if not out:
        raise ConfigError("bench.serving.jsonl", f"{path} holds no requests")
    return sorted(out, key=lambda r: r.offset_s)


def run(engine, requests: list[TimedRequest], clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Feed ``requests`` to ``engine`` at their arrival times and step it until all finish."""
    clock = clock or engine.clock
    start = clock()
    pending = list(requests)
    submitted = []
    steps_before = engine.stats().num_steps
    while pending or engine.has_unfinished():
        now = clock()
        while pending and start + pending[0].offset_s <= now:
            r = pending.pop(0)
            submitted.append(engine.add_request(
                r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                arrival=start + r.offset_s))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            sleep(start + pending[0].offset_s - now)
    end = clock()
    steps = engine.step_records()[steps_before:]
    return summary(submitted, end - start, steps)


def summary(requests, wall_s: float, steps=()) -> dict[str, Any]:
    times = [r.times for r in requests]
    out_tokens = sum(len(r.token_ids) - len(r.prompt_token_ids) for r in requests)
    return {
        "requests": len(requests), "wall_s": wall_s,
        "request_throughput": len(requests) / wall_s if wall_s else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s else None,
        "ttft_s": summarize([t.ttft for t in times if t.ttft is not None]),
        "tpot_s": summarize([t.tpot for t in times if t.tpot is not None]),
        "itl_s": summarize([x for t in times for x in t.itl]),
        "e2e_s": summarize([t.e2e for t in times if t.e2e is not None]),
        "ttft_values": [t.ttft for t in times if t.ttft is not None],
        "itl_values": [x for t in times for x in t.itl],
        "max_decode_batch": max((s.decode_seqs for s in steps), default=0),
        "speculative": speculative_summary(list(steps)),
    }
