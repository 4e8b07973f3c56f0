"""The device's ceilings, measured once and cached: matrix-multiply peak and memory bandwidth.

Peak: the best of square matmuls in the dtype the model runs in (large enough to be
compute-bound). Bandwidth: the best copy of a buffer far larger than any cache, counting bytes
read plus bytes written; on a CPU on large pages, as the native backend's weights lie
(``twophase.large_pages``). Both are what torch reaches on this device, the ceiling every
backend here shares, not the vendor's datasheet figure.

A ceiling is a best case, so each kernel runs until its fastest few runs agree (within
``Settle.tolerance``) or a time cap passes: a short calibration on a busy machine once drew the
roofline below the measurements it bounds. The cache records with each entry when it was
measured, how far apart the best runs were and how busy the machine was, so a report can say
when a ceiling deserves no trust; an entry without those records is measured again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from twophase import large_pages
from twophase.device import cpu_flags, cpu_name
from twophase.measure import machine
from twophase.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ceilings:
    device: str                  # the device's name
    dtype: str
    peak_flops: float            # FLOP/s
    bandwidth: float             # bytes/s
    threads: int
    peak_spread: float = 0.0     # (slowest - fastest) / fastest of the best few matmul runs
    bandwidth_spread: float = 0.0
    measured_at: str = ""        # ISO 8601, local time with its offset
    machine: dict[str, Any] = field(default_factory=dict)   # machine.between() over the calibration

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which work is compute-bound."""
        return self.peak_flops / self.bandwidth

    @property
    def busy(self) -> list[str]:
        """Why the machine was not quiet while these were measured (empty: it was)."""
        return machine.busy_reasons(self.machine)


# the records an entry must carry to be trusted; older twophase versions wrote none of them
RECORDS = ("peak_spread", "bandwidth_spread", "measured_at", "machine")


@dataclass(frozen=True)
class Settle:
    """When a kernel's timing is done: at least ``min_runs`` runs and ``min_s`` seconds, then as
    soon as the ``best_of`` fastest agree within ``tolerance``, or at ``cap_s`` regardless."""
    best_of: int = 3
    tolerance: float = 0.05
    min_runs: int = 5
    min_s: float = 2.0
    cap_s: float = 20.0


# a CPU's matmul engines: the flags of the instructions each runs on, widest last (int8 and
# float32 run everywhere torch does: AVX2's madd and FMA at least)
CPU_ENGINES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: ("avx2", "avx512f"),
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
    torch.int8: ("avx2", "avx_vnni", "avx512_vnni", "amx_int8"),
}
ALWAYS = (torch.float32, torch.int8)


def cpu_engines() -> dict[torch.dtype, list[str]]:
    """The engines this CPU runs natively, each with the instruction sets it has for it."""
    have = cpu_flags()
    found = {d: [f for f in flags if f in have] for d, flags in CPU_ENGINES.items()}
    return {d: f for d, f in found.items() if f or d in ALWAYS}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _cache_path() -> Path:
    return cache_dir() / "calibration.json"


# A CPU's bandwidth is read on the engine's large pages (twophase.large_pages), and its key says
# so: a figure measured on 4 KB pages (much lower: docs/measurements.md), and the
# simulator's efficiencies fitted against the engine before its weights moved onto large pages
# (simulate.devices.fit_key), are measured again rather than reused.
CPU_PAGES = "large-pages"


def _key(device: torch.device, dtype: torch.dtype) -> str:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = f"{device_name(device)}|{str(dtype).removeprefix('torch.')}|threads={threads}"
    return f"{key}|{CPU_PAGES}" if device.type == "cpu" else key


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("ignoring %s, which cannot be read (%s): calibrating again", path, exc)
        return {}
    return saved if isinstance(saved, dict) else {}


def stale(entry: Any) -> str | None:
    """Why a cached entry cannot be used (None: it can)."""
    if not isinstance(entry, dict):
        return "it is not a record"
    missing = [k for k in RECORDS if k not in entry]
    if missing:
        return f"it has no {', '.join(missing)} (written by an older twophase)"
    unknown = set(entry) - {f.name for f in fields(Ceilings)}
    if unknown:
        return f"it has fields this twophase does not know: {', '.join(sorted(unknown))}"
    return None


def ceilings(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             force: bool = False, settle: Settle | None = None) -> Ceilings:
    """The cached ceilings for this device and dtype, measured now if there are none (or the
    cached ones lack the records that say how far to trust them)."""
    device = torch.device(device)
    path, key = _cache_path(), _key(device, dtype)
    saved = _read(path)
    why = "--force" if force else ("none cached" if key not in saved else stale(saved[key]))
    if why is None:
        return Ceilings(**saved[key])
    if key in saved and not force:
        log.warning("calibration for %s in %s is stale, measuring again: %s", key, path, why)
    c = measure(device, dtype, settle)
    saved[key] = asdict(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2) + "\n")
    return c


def engine_ceilings(device: str | torch.device, dtype: torch.dtype, fallback: torch.dtype) -> Ceilings:
    """The ceilings of the engine a phase ran on (``dtype``), or ``fallback``'s (the model's
    dtype) where this torch cannot time that engine (``torch._int_mm`` on an older CPU build)."""
    try:
        return ceilings(device, dtype)
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("no %s ceiling here (%s): the roofline takes %s's", dtype, exc, fallback)
        return ceilings(device, fallback)


def measure(device: torch.device, dtype: torch.dtype, settle: Settle | None = None) -> Ceilings:
    """Both ceilings, with the records of how they were taken."""
    settle = settle or Settle()
    log.info("calibrating %s (%s): matmul peak and memory bandwidth, until the best %d runs of "
             "each agree within %.0f%% (at most %.0f s each)", device_name(device), dtype,
             settle.best_of, 100 * settle.tolerance, settle.cap_s)
    before = machine.sample()
    peak, peak_spread = _peak(device, dtype, settle)
    bandwidth, bw_spread = _bandwidth(device, settle)
    c = Ceilings(device_name(device), str(dtype).removeprefix("torch."), peak, bandwidth,
                 torch.get_num_threads() if device.type == "cpu" else 0, peak_spread, bw_spread,
                 datetime.now().astimezone().isoformat(timespec="seconds"),
                 machine.between(before, machine.sample()))
    log.info("calibrated: %.1f GFLOP/s (best runs %.1f%% apart), %.1f GB/s (%.1f%% apart), %.0f s",
             peak / 1e9, 100 * peak_spread, bandwidth / 1e9, 100 * bw_spread, c.machine["seconds"])
    if c.busy:
        log.warning("the machine was not quiet while calibrating (%s): the ceilings may be low; "
                    "run `twophase calibrate --force` when it is", "; ".join(c.busy))
    return c


def spread(times: list[float], best_of: int) -> float:
    """How far apart the ``best_of`` fastest times are, relative to the fastest (inf: too few)."""
    if len(times) < best_of:
        return float("inf")
    best = sorted(times)[:best_of]
    return (best[-1] - best[0]) / best[0]


def settled(run_once: Callable[[], float], settle: Settle) -> tuple[float, float]:
    """(fastest time, spread of the best few) of ``run_once`` (which returns one run's
    seconds), run until the best few agree or the cap passes."""
    times: list[float] = []
    while True:
        times.append(run_once())
        s, spent = spread(times, settle.best_of), sum(times)
        if len(times) >= settle.min_runs and spent >= settle.min_s and s <= settle.tolerance:
            return min(times), s
        if spent >= settle.cap_s and len(times) >= settle.best_of:      # a finite spread to record
            log.warning("the best %d of %d runs still differ by %.0f%% after %.0f s; is the machine busy?",
                        settle.best_of, len(times), 100 * s, spent)
            return min(times), s


def _once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def _peak(device: torch.device, dtype: torch.dtype, settle: Settle) -> tuple[float, float]:
    sizes = (8192, 16384) if device.type == "cuda" else (1024, 2048)
    best, best_spread = 0.0, float("inf")
    for n in sizes:
        if dtype == torch.int8:                 # int8 dots (VNNI, AMX): int32 sums, as oneDNN runs them
            a = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
            b = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
        else:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
        mm = torch._int_mm if dtype == torch.int8 else torch.matmul
        _once(lambda a=a, b=b, mm=mm: mm(a, b), device)               # warm-up
        t, s = settled(lambda a=a, b=b, mm=mm: _once(lambda: mm(a, b), device), settle)
        if 2 * n ** 3 / t > best:
            best, best_spread = 2 * n ** 3 / t, s
    return best, best_spread


def _bandwidth(device: torch.device, settle: Settle) -> tuple[float, float]:
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    if device.type == "cpu":      # on the memory the engine streams: large pages where the OS gives them
        src = torch.from_numpy(large_pages.region(nbytes)).view(torch.float32).fill_(1.0)
        dst = torch.from_numpy(large_pages.region(nbytes)).view(torch.float32)
    else:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
    _once(lambda: dst.copy_(src), device)                             # warm-up
    t, s = settled(lambda: _once(lambda: dst.copy_(src), device), settle)
    return 2 * nbytes / t, s
