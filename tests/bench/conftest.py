"""Every bench test gets a cache of its own, and fails if anything it runs writes a calibration
anywhere else: a calibration taken by a test (on a loaded machine, with a test's settings) once
could have replaced the user's and drawn every later roofline wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from twophase.paths import cache_dir


def _watched() -> list[Path]:
    """The calibration files no test may touch: the suite's shared cache (set by the root
    conftest), the user's it was derived from, and the default one."""
    suite = cache_dir()
    roots = {suite, Path(str(suite).removesuffix("-tests")), Path.home() / ".cache" / "twophase"}
    return sorted(root / "calibration.json" for root in roots)


def _fingerprint(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch) -> Path:
    """``TWOPHASE_CACHE`` for this test (and the subprocesses it starts) only."""
    before = {p: _fingerprint(p) for p in _watched()}
    root = tmp_path_factory.mktemp("twophase-cache")
    monkeypatch.setenv("TWOPHASE_CACHE", str(root))
    yield root
    written = [str(p) for p, fp in before.items() if _fingerprint(p) != fp]
    if written:
        pytest.fail(f"this test wrote {', '.join(written)}; tests calibrate under their own "
                    f"TWOPHASE_CACHE (the own_cache fixture) or monkeypatch the measurement")


QUIET = {"load_before": 0.0, "load_after": 0.1, "cores": 2, "seconds": 10.0, "steal_fraction": 0.0,
         "others_cpu_fraction": 0.0}


@pytest.fixture
def seed_calibration(own_cache):
    """Writes current calibration entries for this CPU into the test's cache, so a bench run
    under it measures nothing; one entry per thread count, as the bench process may run at
    another count than this one."""
    from twophase.bench import calibrate

    def seed(peak_flops: float, bandwidth: float, **records) -> None:
        name = calibrate.device_name(torch.device("cpu"))
        saved = {}
        for threads in range(1, max(os.cpu_count() or 1, torch.get_num_threads()) + 1):
            saved[f"{name}|float32|threads={threads}|{calibrate.CPU_PAGES}"] = {
                "device": name, "dtype": "float32", "peak_flops": peak_flops, "bandwidth": bandwidth,
                "threads": threads, "peak_spread": 0.01, "bandwidth_spread": 0.01,
                "measured_at": "2026-01-01T10:00:00+00:00", "machine": dict(QUIET), **records}
        (own_cache / "calibration.json").write_text(json.dumps(saved, indent=2))

    return seed


@pytest.fixture
def one_torch_thread():
    """torch on one thread for this test only: the tiny model's steps last microseconds, and two
    threads waiting on each other on a shared machine make them last milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
