"""Calibration: kernels run until their best runs agree, entries record when and under what load
they were measured, old entries are measured again, and no test writes outside its own cache."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import pytest
import torch

from twophase.bench import calibrate
from twophase.measure import machine
from twophase.paths import cache_dir


def scripted(times: list[float]):
    """A ``run_once`` returning ``times`` in order (seconds of each run)."""
    it = iter(times)
    return lambda: next(it)


def test_a_kernel_runs_until_its_best_runs_agree():
    settle = calibrate.Settle(best_of=3, tolerance=0.05, min_runs=5, min_s=0.0, cap_s=100.0)
    # the best three agree within 5% only at the 7th run: 1.0, 1.02, 1.04
    best, spread = calibrate.settled(scripted([2.0, 1.0, 1.5, 1.3, 1.2, 1.02, 1.04, 9.0]), settle)
    assert best == 1.0 and spread == pytest.approx(0.04)
    # ... and not before min_runs, even when the first three agree
    runs = [1.0, 1.0, 1.0, 1.01, 1.0, 7.0]
    calibrate.settled(scripted(runs), settle)
    with pytest.raises(StopIteration):
        calibrate.settled(scripted(runs[:4]), settle)


def test_a_kernel_that_never_settles_stops_at_the_cap_with_its_spread(caplog):
    settle = calibrate.Settle(best_of=3, tolerance=0.05, min_runs=2, min_s=0.0, cap_s=10.0)
    with caplog.at_level(logging.WARNING):
        best, spread = calibrate.settled(scripted([1.0, 2.0, 3.0, 4.0, 5.0]), settle)   # 10 s
    assert best == 1.0 and spread == pytest.approx(2.0)
    assert "is the machine busy" in caplog.text
    # past the cap after one run: still the best few, so the spread recorded is a number
    best, spread = calibrate.settled(scripted([20.0, 21.0, 22.0, 99.0]), settle)
    assert spread == pytest.approx(0.1)


def fake_measurements(monkeypatch, calls: list[str]) -> None:
    monkeypatch.setattr(calibrate, "_peak", lambda d, t, s: calls.append("peak") or (2e9, 0.01))
    monkeypatch.setattr(calibrate, "_bandwidth", lambda d, s: calls.append("bw") or (1e9, 0.02))


def test_calibration_is_cached_with_its_date_spread_and_load(monkeypatch, own_cache):
    calls: list[str] = []
    fake_measurements(monkeypatch, calls)
    c = calibrate.ceilings("cpu", torch.float32)
    assert c.peak_flops == 2e9 and c.ridge == 2.0 and (c.peak_spread, c.bandwidth_spread) == (0.01, 0.02)
    assert abs((datetime.now().astimezone() - datetime.fromisoformat(c.measured_at)).total_seconds()) < 60
    assert {"load_before", "load_after", "steal_fraction", "others_cpu_fraction", "cores"} <= set(c.machine)
    assert calibrate.ceilings("cpu", torch.float32) == c and calls == ["peak", "bw"]
    entry = json.loads((own_cache / "calibration.json").read_text())[calibrate._key(torch.device("cpu"),
                                                                                     torch.float32)]
    assert entry["measured_at"] == c.measured_at and entry["machine"] == c.machine   # readable JSON
    calibrate.ceilings("cpu", torch.float32, force=True)
    assert calls == ["peak", "bw"] * 2


@pytest.mark.parametrize("entry, why", [
    ({"device": "x", "dtype": "float32", "peak_flops": 1e12, "bandwidth": 1e11, "threads": 2},
     "has no peak_spread, bandwidth_spread, measured_at, machine"),
    ("garbage", "not a record"),
])
def test_an_old_or_broken_entry_is_measured_again_and_says_why(monkeypatch, own_cache, caplog, entry, why):
    key = calibrate._key(torch.device("cpu"), torch.float32)
    (own_cache / "calibration.json").write_text(json.dumps({key: entry, "other|float32|threads=1": entry}))
    calls: list[str] = []
    fake_measurements(monkeypatch, calls)
    with caplog.at_level(logging.WARNING):
        c = calibrate.ceilings("cpu", torch.float32)
    assert calls == ["peak", "bw"] and c.peak_flops == 2e9
    assert "stale" in caplog.text and why in caplog.text
    saved = json.loads((own_cache / "calibration.json").read_text())
    assert saved[key]["measured_at"] and saved["other|float32|threads=1"] == entry    # others kept


def test_an_unreadable_cache_file_is_measured_again(monkeypatch, own_cache, caplog):
    (own_cache / "calibration.json").write_text("{not json")
    fake_measurements(monkeypatch, [])
    with caplog.at_level(logging.WARNING):
        assert calibrate.ceilings("cpu", torch.float32).peak_flops == 2e9
    assert "cannot be read" in caplog.text


def test_a_short_real_calibration_records_everything(own_cache):
    settle = calibrate.Settle(min_runs=2, min_s=0.0, cap_s=0.2)
    c = calibrate.ceilings("cpu", torch.float32, settle=settle)
    assert c.peak_flops > 0 and c.bandwidth > 0
    assert 0 <= c.peak_spread < float("inf") and 0 <= c.bandwidth_spread < float("inf")
    assert "Infinity" not in (own_cache / "calibration.json").read_text()        # plain JSON
    assert c.machine["load_before"] is not None and c.machine["seconds"] > 0
    assert (own_cache / "calibration.json").exists()


def test_bench_tests_calibrate_in_a_cache_of_their_own(own_cache):
    """The own_cache fixture (tests/bench/conftest.py) also fails any test that writes the
    user's or the suite's calibration."""
    assert cache_dir() == own_cache and calibrate._cache_path().parent == own_cache


def write_proc_stat(path: Path, user: int, idle: int, steal: int | None) -> Path:
    fields = [user, 0, 0, idle, 0, 0, 0] + ([steal, 0, 0] if steal is not None else [])
    path.write_text(f"cpu  {' '.join(map(str, fields))}\ncpu0 1 2 3 4\ncpu1 1 2 3 4\nintr 5\n")
    return path


def test_steal_and_other_processes_cpu_are_read_from_proc_stat(tmp_path, monkeypatch):
    busy, steal, total, cpus = machine._proc_stat(write_proc_stat(tmp_path / "a", 300, 500, 200))
    assert (busy, steal, total, cpus) == (300, 200, 1000, 2)
    assert machine._proc_stat(write_proc_stat(tmp_path / "b", 300, 500, None))[1] is None
    monkeypatch.setattr(machine.os, "sysconf", lambda name: 100)
    # over 10 s on 2 CPUs (2,000 jiffies): 1,200 busy, of which this process 4 s; 100 stolen
    a = machine.Sample(0.0, 0.2, 1000, 50, 10000, 2, 1.0)
    b = machine.Sample(10.0, 1.9, 2200, 150, 12000, 2, 5.0)
    m = machine.between(a, b)
    assert m["steal_fraction"] == pytest.approx(0.05)
    assert m["others_cpu_fraction"] == pytest.approx((12 - 4) / 20)
    assert (m["load_before"], m["load_after"], m["cores"]) == (0.2, 1.9, 2)


@pytest.mark.parametrize("record, reason", [
    ({"load_before": 1.2, "cores": 2}, "1-minute load 1.20 on 2 cores"),
    ({"load_before": 0.1, "cores": 2, "others_cpu_fraction": 0.4}, "other processes used 40%"),
    ({"load_before": 0.1, "cores": 2, "steal_fraction": 0.08}, "stole 8%"),
])
def test_a_busy_machine_is_named_and_a_quiet_one_is_not(record, reason):
    assert any(reason in r for r in machine.busy_reasons(record))
    assert machine.busy_reasons({"load_before": 0.9, "load_after": 2.0, "cores": 2,
                                 "others_cpu_fraction": 0.2, "steal_fraction": 0.01}) == []


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma"}, {torch.float32: ["avx2"], torch.int8: ["avx2"]}),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16"},
     {torch.float32: ["avx2", "avx512f"], torch.int8: ["avx2", "avx512_vnni", "amx_int8"],
      torch.bfloat16: ["avx512_bf16", "amx_bf16"], torch.float16: ["avx512_fp16"]}),
])
def test_the_engines_are_those_the_cpus_flags_name(monkeypatch, flags, want):
    monkeypatch.setattr(calibrate, "cpu_flags", lambda: frozenset(flags))
    assert calibrate.cpu_engines() == want


def test_an_int8_ceiling_times_int8_dots(own_cache):
    settle = calibrate.Settle(min_runs=2, min_s=0.0, cap_s=0.2)
    c = calibrate.ceilings("cpu", torch.int8, settle=settle)
    assert c.dtype == "int8" and c.peak_flops > 0
    assert calibrate.ceilings("cpu", torch.float32, settle=settle).dtype == "float32"   # its own entry


def test_an_engine_this_torch_cannot_time_falls_back_to_the_models_dtype(monkeypatch, own_cache, caplog):
    real = calibrate.measure

    def measure(device, dtype, settle=None):
        if dtype == torch.int8:
            raise RuntimeError("_int_mm: not implemented for this CPU")
        return real(device, dtype, calibrate.Settle(min_runs=2, min_s=0.0, cap_s=0.2))

    monkeypatch.setattr(calibrate, "measure", measure)
    with caplog.at_level(logging.WARNING):
        c = calibrate.engine_ceilings("cpu", torch.int8, torch.float32)
    assert c.dtype == "float32" and "no torch.int8 ceiling here" in caplog.text


def test_each_phases_roofline_takes_the_ceiling_of_the_engine_it_ran_on():
    """Prefill on bf16 tiles beside int8 decode dots: the prefill bound follows prefill's peak,
    decode's bound and crossover decode's."""
    from types import SimpleNamespace

    from twophase.bench.roofline import CostModel
    from twophase.bench.run import _roofline
    from twophase.models.shapes import named_shape

    cost = CostModel(named_shape("smollm2-135m"), 0.5625, 4)
    b = SimpleNamespace(prompt_lens=[512], cache_depth=0, decode_context=128, batch_sizes=[1, 32])
    slow = SimpleNamespace(peak_flops=1e11, bandwidth=2e10)
    fast = SimpleNamespace(peak_flops=2e12, bandwidth=2e10)
    same = _roofline(cost, b, slow, slow, {})
    tiles = _roofline(cost, b, fast, slow, {})
    assert tiles["prefill_bound_tokens_per_s"]["512"] > 5 * same["prefill_bound_tokens_per_s"]["512"]
    assert tiles["decode_bound_tokens_per_s"] == same["decode_bound_tokens_per_s"]
    assert tiles["decode_crossover_batch"] == same["decode_crossover_batch"]
