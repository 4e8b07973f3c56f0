"""How quiet the machine was while something was measured.

A measurement taken while other work shares the CPU is slow by an amount nobody can recover
afterwards, so the bench and the calibration record, beside their figures: the 1-minute load
average before and after, the share of CPU time the hypervisor stole (``steal`` in
``/proc/stat``, where the kernel reports it) and the share other processes used meanwhile
(all busy CPU time less this process's own). The load average alone cannot tell: it counts our
own threads once we start.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUIET_LOAD = 0.5          # 1-minute load per core above which the machine was busy before we began
QUIET_OTHERS = 0.25       # share of all CPU time other processes may use while we measure
QUIET_STEAL = 0.05        # share of CPU time the hypervisor may steal


@dataclass(frozen=True)
class Sample:
    wall: float                        # time.perf_counter()
    load1: float | None                # 1-minute load average
    busy: int | None                   # jiffies all CPUs spent working (steal excluded)
    steal: int | None                  # jiffies stolen (None: the kernel does not say)
    total: int | None                  # all jiffies
    cpus: int                          # CPUs /proc/stat counts (else os.cpu_count())
    own_s: float                       # this process's user + system CPU seconds


def _proc_stat(path: Path = Path("/proc/stat")) -> tuple[int | None, int | None, int | None, int]:
    """(busy, steal, total, cpus) from ``/proc/stat``; Nones where it is missing."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None, None, os.cpu_count() or 1
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit()) or os.cpu_count() or 1
    fields = [int(x) for x in lines[0].split()[1:9]] if lines and lines[0].startswith("cpu ") else []
    if len(fields) < 4:
        return None, None, None, cpus
    steal = fields[7] if len(fields) > 7 else None
    total = sum(fields)                 # guest time is already inside user time
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle - (steal or 0), steal, total, cpus


def sample() -> Sample:
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    busy, steal, total, cpus = _proc_stat()
    t = os.times()
    return Sample(time.perf_counter(), load1, busy, steal, total, cpus, t.user + t.system)


def between(a: Sample, b: Sample) -> dict[str, Any]:
    """What happened on the machine from ``a`` to ``b``: a JSON-ready record."""
    out: dict[str, Any] = {"load_before": a.load1, "load_after": b.load1, "cores": b.cpus,
                           "seconds": b.wall - a.wall, "steal_fraction": None, "others_cpu_fraction": None}
    if a.total is None or b.total is None or b.total <= a.total:
        return out
    jiffies = b.total - a.total
    if a.steal is not None and b.steal is not None:
        out["steal_fraction"] = (b.steal - a.steal) / jiffies
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others_s = (b.busy - a.busy) / hz - (b.own_s - a.own_s)
    out["others_cpu_fraction"] = max(0.0, others_s / (jiffies / hz))
    return out


def busy_reasons(m: dict[str, Any] | None) -> list[str]:
    """Why a record from ``between`` says the machine was not quiet (empty: it was)."""
    if not m:
        return []
    cores = m.get("cores") or 1
    reasons = []
    if m.get("load_before") is not None and m["load_before"] > QUIET_LOAD * cores:
        reasons.append(f"1-minute load {m['load_before']:.2f} on {cores} cores before starting")
    if m.get("others_cpu_fraction") is not None and m["others_cpu_fraction"] > QUIET_OTHERS:
        reasons.append(f"other processes used {100 * m['others_cpu_fraction']:.0f}% of the CPU meanwhile")
    if m.get("steal_fraction") is not None and m["steal_fraction"] > QUIET_STEAL:
        reasons.append(f"the hypervisor stole {100 * m['steal_fraction']:.0f}% of the CPU time")
    return reasons
