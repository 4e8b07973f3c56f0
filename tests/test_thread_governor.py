"""Fewer threads while other processes hold cores: the count from /proc/stat's readings, and a
real busy process seen as one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from twophase.measure.machine import Sample
from twophase.measure.thread_governor import ThreadGovernor

HZ = os.sysconf("SC_CLK_TCK")


class Machine:
    """Readings a test writes: each second of wall, ``others`` cores' worth of other processes'
    CPU time and ``own`` of ours, on ``cpus`` CPUs."""

    def __init__(self, cpus: int):
        self.cpus, self.t, self.busy, self.own = cpus, 0.0, 0, 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += round((others + own) * seconds * HZ)
        self.own += own * seconds

    def sample(self) -> Sample:
        return Sample(self.t, None, self.busy, 0, round(self.t * self.cpus * HZ), self.cpus, self.own)


def governor(m: Machine, max_threads: int, usable: int | None = None) -> ThreadGovernor:
    g = ThreadGovernor(max_threads, interval_s=0.25, clock=lambda: m.t, sample=m.sample,
                       usable_cores=usable if usable is not None else m.cpus)
    assert g.threads() == max_threads         # the first step: the first reading's start
    return g


def test_what_happens_before_the_first_step_is_not_a_neighbour():
    """A load's own work the OS does elsewhere (readahead, page zeroing) would read as others."""
    m = Machine(2)
    g = ThreadGovernor(2, interval_s=0.25, clock=lambda: m.t, sample=m.sample, usable_cores=2)
    m.run(2.0, others=1.5, own=0.5)           # loading
    assert g.threads() == 2
    m.run(0.5, others=0.0, own=2.0)
    assert g.threads() == 2


@pytest.mark.parametrize("others,want", [(0.0, 2), (0.5, 2), (0.7, 1), (1.0, 1), (2.0, 1)])
def test_a_core_others_hold_is_given_up(others, want):
    m = Machine(2)
    g = governor(m, 2)
    m.run(1.0, others=others, own=2.0 - min(others, 1.0))
    assert g.threads() == want


def test_the_count_comes_back_when_the_neighbour_leaves_and_is_read_at_most_every_interval():
    m = Machine(4)
    g = governor(m, 4)
    m.run(1.0, others=2.0, own=2.0)
    assert g.threads() == 2
    m.run(0.1, others=0.0, own=2.0)
    assert g.threads() == 2                   # within the interval: the last count
    m.run(0.5, others=0.0, own=4.0)
    assert g.threads() == 4


def test_what_others_did_while_this_process_sat_idle_is_not_held_against_it():
    """Another engine's burst during a pause (two engines taking turns, say) is over when the
    next step comes; a neighbour still there is read within the next interval."""
    m = Machine(2)
    g = governor(m, 2)
    m.run(0.5, others=1.0, own=1.0)
    assert g.threads() == 1                   # stepping beside a neighbour
    m.run(3.0, others=2.0, own=0.0)           # idle while another process ran on both cores
    assert g.threads() == 2
    m.run(0.3, others=1.0, own=1.0)
    assert g.threads() == 1


def test_others_outside_the_process_mask_leave_its_cores_alone():
    m = Machine(8)
    g = governor(m, 2, usable=2)              # two of eight CPUs are ours
    m.run(1.0, others=5.0, own=2.0)           # six free outside: they take it
    assert g.threads() == 2
    m.run(1.0, others=7.0, own=1.0)
    assert g.threads() == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.exists("/proc/stat"), reason="needs Linux and two cores")
def test_a_real_busy_process_is_seen():
    cores = len(os.sched_getaffinity(0))
    g = ThreadGovernor(cores, interval_s=0.5)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores - 1)]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and g.threads() == cores:
            time.sleep(0.1)
        assert g.threads() < cores, f"others at {g.others_cores:.2f} cores"
    finally:
        for p in spinners:
            p.kill()
            p.wait()
