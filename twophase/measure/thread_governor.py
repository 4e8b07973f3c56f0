"""How many threads a step should run on now: the configured count, less the cores other
processes keep busy.

A native decode step is hundreds of OpenMP barriers. When another process holds one of the cores
the step's threads run on, the thread sharing that core runs only in the scheduler's turns, and
at every barrier its partner waits for it: on a 2-core Zen 3, decode at batch 1 fell from 99 to
29 tokens/s beside a one-core busy loop (``benchmarks/shared_cpu.py``). On one thread fewer the
barriers meet at once and the busy core is left to its owner. A passive wait (OpenMP's
``OMP_WAIT_POLICY=passive``) also survives the neighbour but costs every barrier a sleep and a
wake-up: half the quiet speed on that machine.

The count follows ``/proc/stat``: every ``interval_s`` the CPU time all processes used, less
this process's own, is how many cores others hold; a core counts as held from ``HELD`` of it.
A reading spans only time this process was stepping: after ``idle_s`` without a step, what
others did meanwhile (another engine's burst, say) says nothing of now, so the count starts
again from all threads and the next interval's reading decides.
Where ``/proc/stat`` is missing (not Linux) the configured count stands.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from twophase.measure import machine

log = logging.getLogger(__name__)

HELD = 0.6                  # of a core's time others use before it counts as theirs


class ThreadGovernor:
    def __init__(self, max_threads: int, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], machine.Sample] = machine.sample,
                 usable_cores: int | None = None, name: str = "threads", idle_s: float = 1.0):
        self.max_threads = max_threads
        self.current = max_threads
        self.interval_s = interval_s
        self.idle_s = idle_s
        self.name = name
        self._clock, self._sample = clock, sample
        self._usable = usable_cores if usable_cores is not None else _usable_cores()
        self._last: machine.Sample | None = None    # taken at the first step, not at load: what
        self._last_t = 0.0                          # the OS does for a load (readahead) is not a neighbour
        self.others_cores = 0.0             # the last reading: cores other processes kept busy
        self._last_call = 0.0

    def threads(self) -> int:
        """The count for the next step (re-read at most every ``interval_s``)."""
        now = self._clock()
        idle, self._last_call = self._last is None or now - self._last_call > self.idle_s, now
        if idle:                                    # the first step, or the first after a pause
            self._last, self._last_t = self._sample(), now
            self._set(self.max_threads)
            return self.current
        if now - self._last_t < self.interval_s:
            return self.current
        s = self._sample()
        rec = machine.between(self._last, s)
        self._last, self._last_t = s, now
        share = rec.get("others_cpu_fraction")
        if share is None:
            return self.current
        self.others_cores = share * s.cpus
        # others run on the cores outside this process's mask first; what is left is on ours
        held_here = max(0.0, self.others_cores - max(0, s.cpus - self._usable))
        held = math.floor(held_here + 1 - HELD)
        self._set(max(1, min(self.max_threads, self._usable - held)))
        return self.current

    def _set(self, n: int) -> None:
        if n != self.current:
            log.info("%s: %d of %d threads (other processes keep %.1f cores busy)",
                     self.name, n, self.max_threads, self.others_cores)
            self.current = n


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
