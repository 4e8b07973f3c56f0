"""Where a load's time went: seconds a stage, and the line a log or report shows of them."""

from __future__ import annotations

import time

SLOW_LOAD_S = 2.0            # past this a load says where its time went


class StageTimes:
    """Seconds spent in each stage of a load, so a slow load says where its time went."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now


def load_line(r: dict) -> str:
    """``1.31 s``, or for a slow load ``12.10 s (memory plan 10.52 s, backend load 1.30 s, ...)``."""
    total = r["load_time_s"]
    stages = sorted(r.get("load_breakdown_s", {}).items(), key=lambda kv: -kv[1])
    if total < SLOW_LOAD_S or not stages:
        return f"{total:.2f} s"
    return f"{total:.2f} s (" + ", ".join(f"{k} {v:.2f} s" for k, v in stages if v >= 0.01) + ")"
