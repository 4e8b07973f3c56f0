"""A virtual clock: the engine reads it where it would read ``time.perf_counter``; simulated
backends advance it by the time each step would take on the device."""

from __future__ import annotations


class VirtualClock:
    """Seconds since the simulation started; moves only when something advances it."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not run backwards ({seconds} s)")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """What ``time.sleep`` is to the wall clock: the idle engine jumps to the next arrival."""
        self.now += max(0.0, seconds)
