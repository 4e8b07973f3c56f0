"""The CPU fit is kept one a backend and weight format: fitting one leaves the others' alone,
``cpu_spec`` returns the named one's, and ``twophase simulate --fit`` fits and uses the
config's own backend."""

from __future__ import annotations

import dataclasses

import pytest

from twophase.bench import calibrate
from twophase.config import load_config
from twophase.simulate import devices, fit

CEILINGS = calibrate.Ceilings("cpu", "float32", 1e11, 2e10, 2, 0.0, 0.0, "a test")


@pytest.fixture(autouse=True)
def fits_here(tmp_path, monkeypatch):
    """A fit cache of this test's own over fixed ceilings (nothing calibrated)."""
    monkeypatch.setattr(devices, "fits_path", lambda: tmp_path / "simulate_fit.json")
    monkeypatch.setattr(calibrate, "ceilings", lambda *a, **k: CEILINGS)


def figures(spec: devices.DeviceSpec) -> tuple[float, float, float]:
    return spec.compute_efficiency, spec.bandwidth_efficiency, spec.step_overhead_s


def test_fits_are_kept_per_backend_and_weights():
    base = devices.cpu_spec()
    assert figures(base) == (devices.CPU_COMPUTE_EFFICIENCY, devices.CPU_BANDWIDTH_EFFICIENCY,
                             devices.CPU_STEP_OVERHEAD_S)
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.5, bandwidth_efficiency=0.6,
                                         step_overhead_s=0.07), "m", "t0", backend="torch")
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.9, bandwidth_efficiency=0.4,
                                         step_overhead_s=0.004), "m", "t1", backend="native", quantization="q4")
    assert figures(devices.cpu_spec("float32", "torch", "none")) == (0.5, 0.6, 0.07)
    assert figures(devices.cpu_spec("float32", "native", "q4")) == (0.9, 0.4, 0.004)
    assert figures(devices.device_spec("cpu", "float32", "native", "q4")) == (0.9, 0.4, 0.004)
    # neither another backend nor another weight format takes them: the defaults
    assert figures(devices.cpu_spec("float32", "onnxruntime", "none")) == figures(base)
    assert figures(devices.cpu_spec("float32", "torch", "q4")) == figures(base)
    # refitting one leaves the other as it was
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.3), "m", "t2", backend="torch")
    assert figures(devices.cpu_spec("float32", "native", "q4")) == (0.9, 0.4, 0.004)
    assert devices.cpu_spec("float32", "torch", "none").compute_efficiency == 0.3


def test_the_fitted_backend_is_the_configs():
    def named(backend):
        return devices.fitted_backend(load_config({"backend": backend}))

    assert named({"name": "onnxruntime"}) == "onnxruntime"
    assert named({"name": "auto"}) == "torch"          # simulated as torch, so fitted as torch
    assert named({"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}) == "onnxruntime+native"


def tiny(backend: str, quantization: str = "none"):
    return load_config({"model": {"name": "tiny", "weights": "random", "quantization": quantization},
                        "backend": {"name": backend}})


def test_fit_cpu_runs_and_keeps_the_configs_backend(monkeypatch):
    import twophase.llm

    ran: list[tuple[str, str]] = []

    class Recorded(twophase.llm.LLM):
        def __init__(self, config, *a, **k):
            ran.append((config.phases()[0].name, config.phases()[1].name))
            super().__init__(config, *a, **k)

    monkeypatch.setattr(twophase.llm, "LLM", Recorded)
    measure = fit.measure
    monkeypatch.setattr(fit, "measure", lambda cfg, base, passes=3: measure(cfg, base, passes=1))
    torch_spec = fit.fit_cpu(tiny("torch"))
    assert ran == [("torch", "torch")]
    native_spec = fit.fit_cpu(tiny("native", "q4"))
    assert ran[-1] == ("native", "native")
    assert figures(devices.cpu_spec("float32", "torch", "none")) == figures(torch_spec)
    assert figures(devices.cpu_spec("float32", "native", "q4")) == figures(native_spec)
    stored = devices._read_fits()
    assert sorted((e["backend"], e["quantization"]) for e in stored.values()) == [("native", "q4"), ("torch", "none")]


def test_simulate_on_cpu_uses_the_configs_backends_fit(tmp_path):
    import json

    from twophase.cli import main

    base = devices.cpu_spec()
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.9, bandwidth_efficiency=0.4,
                                         step_overhead_s=0.004), "m", "t", backend="native", quantization="q4")
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.5, bandwidth_efficiency=0.6,
                                         step_overhead_s=0.07), "m", "t", backend="torch")
    for flags, want in ((["--backend", "native", "--quantization", "q4"], (0.9, 0.4, 0.004)),
                        (["--backend", "torch"], (0.5, 0.6, 0.07))):
        out = tmp_path / "sim.json"
        assert main(["simulate", "tiny", *flags, "--device", "cpu", "--requests", "2", "--prompt-len", "8",
                     "--output-len", "2", "--json", str(out)]) == 0
        d = json.loads(out.read_text())["simulation"]["device"]
        assert (d["compute_efficiency"], d["bandwidth_efficiency"], d["step_overhead_s"]) == want
