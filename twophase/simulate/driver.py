"""Requests arriving over time, fed to an engine as its clock passes each arrival; the engine is
stepped while it has work and, idle, waits (a virtual clock jumps) to the next arrival.

The same loop drives a real engine on the wall clock (``clock=time.perf_counter``,
``sleep=time.sleep``), so simulated and measured runs differ only in their backends.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from twophase.bench import serving
from twophase.bench.serving import TimedRequest
from twophase.core.engine import Engine
from twophase.core.outputs import RequestOutput
from twophase.core.sampling_params import SamplingParams
from twophase.errors import ConfigError, RequestRejected

log = logging.getLogger(__name__)


@dataclass
class Run:
    outputs: list[RequestOutput]
    rejected: list[str]
    start: float                 # the clock when the first request could arrive
    host_s: float                # wall-clock seconds the run took on this machine
    # after each step: (time, requests waiting, running, KV blocks in use), the engines' together
    queue: list[tuple[float, int, int, int]] = field(default_factory=list)


def parse_range(text: str, flag: str) -> list[int]:
    """``"64-256"`` (uniform in [64, 256]) or ``"128"`` (every request)."""
    try:
        lo, _, hi = text.partition("-")
        out = [int(lo), int(hi or lo)]
    except ValueError:
        raise ConfigError(flag, f"expected N or MIN-MAX tokens; got {text!r}") from None
    if out[0] < 1 or out[1] < out[0]:
        raise ConfigError(flag, f"expected 1 <= MIN <= MAX; got {text!r}")
    return out


def workload(n: int, rate: float | None, prompt_len: list[int], output_len: list[int], vocab_size: int,
             seed: int = 0, trace: str | None = None) -> list[TimedRequest]:
    """``bench``'s serving workload: synthetic (Poisson at ``rate``, or all at once) or a JSONL
    trace of ``{"prompt_token_ids", "max_tokens", "arrival_s"}`` lines."""
    if trace is not None:
        reqs = serving.trace(Path(trace), rate, output_len[1], seed)
        bad = [i for i, r in enumerate(reqs) if isinstance(r.prompt, str)]
        if bad:
            raise ConfigError("--workload", f"request {bad[0]} gives a text prompt: the simulator "
                              f"has no tokenizer, give prompt_token_ids")
        return reqs
    return serving.synthetic(n, rate, prompt_len, output_len, vocab_size, seed)


def drive(engine: Engine, requests: list[TimedRequest], clock: Callable[[], float] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> Run:
    """Feed ``requests`` at their arrival times (``offset_s`` after the start) and step the
    engine until every one has finished; outputs in the requests' order."""
    clock = clock or engine.clock
    t0 = time.perf_counter()
    start = clock()
    pending = deque(sorted(requests, key=lambda r: r.offset_s))
    done: dict[str, RequestOutput] = {}
    order: list[str] = []
    rejected: list[str] = []
    queue: list[tuple[float, int, int, int]] = []
    while pending or engine.has_unfinished():
        now = clock()
        while pending and start + pending[0].offset_s <= now:
            r = pending.popleft()
            try:
                req = engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                         arrival=start + r.offset_s)
                order.append(req.request_id)
            except RequestRejected as exc:
                rejected.append(str(exc))
        if engine.has_unfinished():
            result = engine.step_with_record()
            for d in result.deltas:
                if d.output is not None:
                    done[d.request_id] = d.output
            if result.record is not None:
                s = engine.stats()
                queue.append((clock(), s.waiting, s.running, s.used_blocks))
            elif clock() == now:
                if not pending:
                    raise RuntimeError("the engine has work but schedules none")
                sleep(start + pending[0].offset_s - now)
        elif pending:
            sleep(start + pending[0].offset_s - now)
    if rejected:
        log.warning("%d requests rejected, e.g.: %s", len(rejected), rejected[0])
    return Run([done[i] for i in order], rejected, start, time.perf_counter() - t0, queue)
