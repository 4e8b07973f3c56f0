"""Questions about this machine and its devices, answered in one place: what a device name
means, how much memory is free on it, what the CPU is and can do, how many threads to use."""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from twophase.errors import BackendUnavailable, ConfigError


def parse_device(device: str) -> torch.device:
    """``backend.device`` as a torch device; a name torch does not know is ``BackendUnavailable``
    (a clear refusal from ``check_available``, not a traceback)."""
    try:
        return torch.device(device)
    except RuntimeError:
        raise BackendUnavailable(f"backend.device {device!r} is not a device name "
                                 f"(use 'cpu', 'cuda' or 'cuda:N')") from None


def require_device(device: str) -> torch.device:
    """``device`` parsed, and present: the engine's KV pool is a torch tensor on it, so torch
    must see it whatever runtime computes there."""
    dev = parse_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(
            f"device {device!r}: torch {torch.__version__} sees no CUDA device (built with CUDA "
            f"{torch.version.cuda or 'none'}), and the engine's KV pool is a torch tensor")
    return dev


def same_device(a: str, b: str) -> bool:
    """``cuda`` and ``cuda:0`` are one device."""
    da, db = torch.device(a), torch.device(b)
    return (da.type, da.index or 0) == (db.type, db.index or 0)


def available_memory(device: str) -> int:
    """Bytes free for weights and the KV pool on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    kib = _proc_kib("/proc/meminfo", "MemAvailable:")
    return kib * 1024 if kib is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident set (its peak where ``/proc`` is not)."""
    kib = _proc_kib("/proc/self/status", "VmRSS:")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a ``/proc`` file, in KiB (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    name, flags = "", frozenset[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return name, flags


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    return _cpuinfo()[0] or os.uname().machine


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``fma``, ...); empty where ``/proc/cpuinfo`` is not."""
    return _cpuinfo()[1]


def cpu_signature() -> str:
    """Name and flags: what code compiled with ``-march=native`` depends on."""
    return cpu_name() + " " + " ".join(sorted(cpu_flags()))


def threads_option(options: dict[str, Any], key: str = "threads",
                   default: int | None = None) -> int:
    """``backend.options.<key>``: a positive thread count (default: torch's, which follows the
    cores this process may use)."""
    n = options.get(key, torch.get_num_threads() if default is None else default)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"backend.options.{key}", f"must be a positive integer; got {n!r}")
    return n


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``): loading leaves
    hundreds of MB freed but held (the unfused halves of q/k/v and gate/up, a runtime's
    temporaries), which would stay resident for the process's life."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc
        pass
