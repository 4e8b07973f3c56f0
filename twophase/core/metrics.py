"""Per-step records and the phase report built from them and from requests' clock readings."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from twophase.core.request import RequestTimes


@dataclass
class StepRecord:
    start: float
    duration: float
    prefill_tokens: int      # prompt tokens computed (decodes excluded)
    prefill_seqs: int
    decode_seqs: int         # one token each
    kv_blocks_used: int
    preemptions: int = 0
    recomputed_tokens: int = 0       # computed tokens the step's preemptions threw away
    draft_tokens: int = 0    # speculative tokens verified this step
    drafted_seqs: int = 0    # decodes that had drafts
    propose_s: float = 0.0   # of ``duration``, the time spent drafting
    # per draft position j: drafts verified there, and kept (a draft is kept only if all before it were)
    drafted_at: tuple[int, ...] = ()
    kept_at: tuple[int, ...] = ()
    accepted_tokens: int = 0  # of which the target kept (each a decode token beyond the first)

    @property
    def decode_tokens(self) -> int:
        """Tokens the decodes produced: one each, plus the drafts kept."""
        return self.decode_seqs + self.accepted_tokens

    @property
    def mix(self) -> str:
        if self.prefill_seqs and self.decode_seqs:
            return "mixed"
        return "prefill" if self.prefill_seqs else "decode"


class StepLog:
    """The last ``maxlen`` steps (a server runs for ever; memory must not grow with it)."""

    def __init__(self, maxlen: int = 200_000):
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)

    def clear(self) -> None:
        self.records.clear()


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def phase_report(steps: list[StepRecord], requests: list[RequestTimes],
                 output_tokens: int) -> dict[str, Any]:
    """Throughput by phase and latency by request. Each phase's rate is measured over the steps
    that ran that phase alone (a mixed step does both at once, so its time belongs to neither);
    mixed steps get their own line in ``steps_by_mix``."""
    prefill_only = [s for s in steps if s.mix == "prefill"]
    decode_only = [s for s in steps if s.mix == "decode"]
    prefill_tokens = sum(s.prefill_tokens for s in steps)
    decode_tokens = sum(s.decode_tokens for s in steps)
    prefill_time = sum(s.duration for s in prefill_only)
    decode_time = sum(s.duration for s in decode_only)
    by_mix: dict[str, dict[str, float]] = {}
    for s in steps:
        m = by_mix.setdefault(s.mix, {"steps": 0, "seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
        m["steps"] += 1
        m["seconds"] += s.duration
        m["prefill_tokens"] += s.prefill_tokens
        m["decode_tokens"] += s.decode_tokens
    wall = (steps[-1].start + steps[-1].duration - steps[0].start) if steps else 0.0
    out_tokens = output_tokens
    return {
        "wall_s": wall,
        "requests": len(requests),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "prefill_tokens": prefill_tokens,
        "prefill_tokens_per_s": (sum(s.prefill_tokens for s in prefill_only) / prefill_time
                                 if prefill_time else None),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": (sum(s.decode_tokens for s in decode_only) / decode_time
                                if decode_time else None),
        "speculative": speculative_summary(steps),
        "steps_by_mix": by_mix,
        "peak_kv_blocks": max((s.kv_blocks_used for s in steps), default=0),
        "preemptions": sum(s.preemptions for s in steps),
        "recomputed_tokens": sum(s.recomputed_tokens for s in steps),
        "ttft_s": summarize([t.ttft for t in requests if t.ttft is not None]),
        "tpot_s": summarize([t.tpot for t in requests if t.tpot is not None]),
        "itl_s": summarize([x for t in requests for x in t.itl]),
        "e2e_s": summarize([t.e2e for t in requests if t.e2e is not None]),
    }


def speculative_summary(steps: list[StepRecord]) -> dict[str, Any] | None:
    """Drafts verified and kept over the run; None where nothing was speculated."""
    drafted = sum(s.draft_tokens for s in steps)
    if not drafted:
        return None
    kept = sum(s.accepted_tokens for s in steps)
    passes = sum(s.drafted_seqs for s in steps)
    # tokens a verify pass gives a sequence: the drafts kept and the target's own one
    return {"draft_tokens": drafted, "accepted_tokens": kept, "acceptance_rate": kept / drafted,
            "verify_passes": passes, "mean_accepted_length": 1 + kept / passes,
            "acceptance_by_position": _by_position(steps),
            "propose_s": sum(s.propose_s for s in steps),
            "verify_s": sum(s.duration - s.propose_s for s in steps if s.draft_tokens)}


def _by_position(steps: list[StepRecord]) -> list[float]:
    """Of the drafts verified at each position, the share kept."""
    drafted: list[int] = []
    kept: list[int] = []
    for s in steps:
        for j, (d, k) in enumerate(zip(s.drafted_at, s.kept_at)):
            if j == len(drafted):
                drafted.append(0)
                kept.append(0)
            drafted[j] += d
            kept[j] += k
    return [k / d for k, d in zip(kept, drafted) if d]


def step_dicts(steps: list[StepRecord]) -> list[dict[str, Any]]:
    return [dict(asdict(s), mix=s.mix) for s in steps]
