"""The device's ceilings, measured once and cached: matrix-multiply peak and memory bandwidth.

Peak: the best of a few square matmuls in the dtype the model runs in (large enough to be
compute-bound). Bandwidth: the best of a few copies of a buffer far larger than any cache,
counting bytes read plus bytes written. Both are what torch reaches on this device, the ceiling
every backend here shares, not the vendor's datasheet figure.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from twophase.device import cpu_name
from twophase.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ceilings:
    device: str                  # the device's name
    dtype: str
    peak_flops: float            # FLOP/s
    bandwidth: float             # bytes/s
    threads: int

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which work is compute-bound."""
        return self.peak_flops / self.bandwidth


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def _cache_path() -> Path:
    return cache_dir() / "calibration.json"


def _key(device: torch.device, dtype: torch.dtype) -> str:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return f"{device_name(device)}|{str(dtype).removeprefix('torch.')}|threads={threads}"


def ceilings(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             force: bool = False) -> Ceilings:
    """The cached ceilings for this device and dtype, measured now if there are none."""
    device = torch.device(device)
    path, key = _cache_path(), _key(device, dtype)
    saved = json.loads(path.read_text()) if path.exists() else {}
    if key in saved and not force:
        return Ceilings(**saved[key])
    log.info("calibrating %s (%s): matmul peak and memory bandwidth", device_name(device), dtype)
    c = Ceilings(device_name(device), str(dtype).removeprefix("torch."), _peak(device, dtype),
                 _bandwidth(device), torch.get_num_threads() if device.type == "cpu" else 0)
    saved[key] = asdict(c)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2))
    return c


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()                                          # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def _peak(device: torch.device, dtype: torch.dtype) -> float:
    sizes = (8192, 16384) if device.type == "cuda" else (1024, 2048)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _timed(lambda a=a, b=b: a @ b, device, 5 if device.type == "cuda" else 3)
        best = max(best, 2 * n ** 3 / t)
    return best


def _bandwidth(device: torch.device) -> float:
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 10 if device.type == "cuda" else 5)
    return 2 * nbytes / t
