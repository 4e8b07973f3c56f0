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


@pytest.mark.parametrize("edit", [
    {"compute_efficiency": "fast"}, {"bandwidth_efficiency": None}, {"step_overhead_s": -1},
    {"token_factors": [[2, "x"]]}, {"token_factors": [[2]]}, {"token_factors": 3}, {"kv_byte_s": float("nan")},
    {"compute_efficiency": 0}, "drop bandwidth_efficiency", "not an object",
])
def test_a_malformed_cached_fit_is_ignored_with_a_warning(edit, caplog):
    """A fit cache edited by hand or written by another version serves the defaults with a warning
    naming the file, where it raised a traceback in ``twophase simulate``."""
    import json

    base = devices.cpu_spec()
    devices.save_fit(dataclasses.replace(base, compute_efficiency=0.5, token_factors=((2, 1.5),)), "m", "t0")
    assert devices.cpu_spec().token_factors == ((2, 1.5),)      # the file as written is taken
    path = devices.fits_path()
    data = json.loads(path.read_text())
    (key, entry), = data.items()
    if edit == "not an object":
        data[key] = "fast"
    elif isinstance(edit, str):
        del entry[edit.split()[1]]
    else:
        entry.update(edit)
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        spec = devices.cpu_spec()
    assert figures(spec) == figures(base) and spec.token_factors == ()
    assert "simulate_fit.json" in caplog.text and "--fit" in caplog.text


def test_a_fit_from_before_the_host_terms_still_serves():
    import json

    devices.save_fit(dataclasses.replace(devices.cpu_spec(), compute_efficiency=0.5), "m", "t0")
    path = devices.fits_path()
    data = json.loads(path.read_text())
    for entry in data.values():
        for k in ("seq_overhead_s", "kv_byte_s", "attention_flop_s", "token_factors"):
            del entry[k]
    path.write_text(json.dumps(data))
    spec = devices.cpu_spec()
    assert spec.compute_efficiency == 0.5 and spec.kv_byte_s == 0.0 and spec.token_factors == ()


def test_the_fitted_backend_is_the_configs():
    def named(backend):
        return devices.fitted_backend(load_config({"backend": backend}))

    assert named({"name": "onnxruntime"}) == "onnxruntime"
    assert named({"name": "auto"}) == "torch"          # simulated as torch, so fitted as torch
    assert named({"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}) == "onnxruntime+native"


def tiny(backend: str, quantization: str = "none"):
    return load_config({"model": {"name": "tiny", "weights": "random", "quantization": quantization},
                        "backend": {"name": backend}})


def test_fit_cpu_runs_and_keeps_the_configs_backend(monkeypatch, caplog):
    import logging

    import twophase.llm

    ran: list[tuple[str, str]] = []

    class Recorded(twophase.llm.LLM):
        def __init__(self, config, *a, **k):
            ran.append((config.phases()[0].name, config.phases()[1].name))
            super().__init__(config, *a, **k)

    monkeypatch.setattr(twophase.llm, "LLM", Recorded)
    measure = fit.measure
    monkeypatch.setattr(fit, "measure", lambda cfg, base, passes=3: measure(cfg, base, passes=1))
    with caplog.at_level(logging.INFO, logger="twophase.bench.run"):
        torch_spec = fit.fit_cpu(tiny("torch"))
    assert ran == [("torch", "torch")]
    said = [r.getMessage() for r in caplog.records if r.name == "twophase.bench.run"]   # progress off a terminal
    assert [m.split(": ", 1)[1] for m in said] == ["sweep warm-up pass", "sweep pass 1 of 1"]
    assert all(m.startswith("fit [") for m in said)
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


def test_the_fit_recovers_efficiencies_and_host_terms_that_made_the_steps():
    """Steps made by known figures (half of peak compute, 0.6 of bandwidth, 5 ms a step, 2 ms a
    sequence, 1 ms per 10 MB of K/V read, 1 ms per 0.1 TFLOP of attention) are fitted back."""
    from twophase.simulate.fit import fit

    parts = [(0.02, 0.01, 1, 1e6, 0.0, 200), (0.001, 0.01, 1, 5e7, 1e9, 1), (0.004, 0.01, 8, 2e7, 3e10, 64),
             (0.01, 0.011, 24, 1e8, 2e8, 24), (0.05, 0.01, 2, 0.0, 5e11, 700), (0.002, 0.012, 4, 3e8, 1e10, 40),
             (0.003, 0.01, 3, 4e7, 2e11, 30), (0.03, 0.01, 3, 2e7, 4e10, 300), (0.0015, 0.012, 1, 8e7, 2e9, 1),
             (0.06, 0.015, 5, 1e8, 6e11, 900), (0.025, 0.02, 2, 3e8, 1e11, 250), (0.001, 0.009, 1, 1.5e8, 3e9, 1)]
    measured = [max(c / 0.5, m / 0.6) + 0.005 + 0.002 * n + 1e-10 * k + 1e-14 * f for c, m, n, k, f, _ in parts]
    err, ec, eb, step, seq, byte, flop, factors = fit(measured, parts)
    assert (ec, eb) == (0.5, 0.6) and err < 1e-5
    assert (step, seq, byte, flop) == pytest.approx((0.005, 0.002, 1e-10, 1e-14), rel=1e-4)
    assert dict(factors) == pytest.approx({24: 1.0, 30: 1.0, 40: 1.0, 64: 1.0}, rel=1e-4)   # on the line


def test_steps_of_few_tokens_off_the_roofline_get_their_measured_factor():
    """A GEMM tiled for some row counts (torch on this CPU: 2 or 3 rows cost more than 4 or 5):
    decodes at batch 2 and 3 taking 1.5x the bound are fitted as factors of about 1.5 at 2 and 3
    tokens, the other counts about 1, the model's error falls, and the cost model applies them
    (linear between the counts measured)."""
    from helpers.simulated import TEST_DEVICE

    from twophase.simulate.fit import fit

    slow = {2: 1.5, 3: 1.5}
    parts = [(0.002, 0.01 + 0.002 * b + 0.004 * i, b, 1e6 * b, 1e7 * b, b) for b in range(1, 9) for i in range(4)]
    parts += [(0.2, 0.02, 1, 0.0, 1e10, 512), (0.1, 0.02, 2, 0.0, 1e10, 256)]
    parts += [(0.0004 * n, 0.02, s, 1e5 * n, 1e8 * n, n) for n, s in ((384, 2), (640, 3), (768, 1), (1024, 2))]
    parts += [(0.002, 0.012, 1, 1e6 * k, 1e7 * k, 1) for k in (2, 5, 9)]
    measured = [max(c / 0.5, m / 0.6) * slow.get(n, 1.0) + 0.004 + 0.001 * s for c, m, s, _, _, n in parts]
    err, ec, eb, step, seq, byte, flop, factors = fit(measured, parts)
    got = dict(factors)
    assert got[2] == pytest.approx(1.5, rel=0.1) and got[3] == pytest.approx(1.5, rel=0.1)
    assert 1 not in got                              # batch 1 anchors the fixed overhead
    assert all(got[b] == pytest.approx(1.0, rel=0.1) for b in (4, 5, 6, 7, 8))
    assert got[2] > 1.3 * max(got[b] for b in (4, 5, 6, 7, 8))
    bounds = [max(c / ec, m / eb) for c, m, *_ in parts]
    plain = sum(abs(b + step + seq * p[2] + byte * p[3] + flop * p[4] - t) / t
                for b, p, t in zip(bounds, parts, measured)) / len(parts)
    assert err < plain / 2
    spec = dataclasses.replace(TEST_DEVICE, token_factors=((1, 1.0), (2, 1.5), (4, 1.0)))
    assert [spec.token_factor(n) for n in (1, 2, 3, 4, 5, 100)] == [1.0, 1.5, 1.25, 1.0, 1.0, 1.0]


def test_short_prefills_off_the_roofline_get_factors_and_the_sweep_steps_at_them():
    """A GEMM off its large-row efficiency at a few dozen rows: single prefills of 32-64 tokens
    taking 1.3x their bound are fitted at about 1.3, a 40-token step between them is costed so,
    and the sweep prefills one prompt alone of each of those lengths (a step each)."""
    from helpers.simulated import TEST_DEVICE

    from twophase.simulate.fit import SHORT_PROMPTS, fit, sweep

    slow = {32: 1.3, 48: 1.3, 64: 1.3}
    parts = [(0.002, 0.01 + 0.002 * b + 0.004 * i, b, 1e6 * b, 1e7 * b, b) for b in range(1, 9) for i in range(4)]
    parts += [(0.002 * n, 0.012, 1, 0.0, 1e8 * n, n) for n in (32, 48, 64) for _ in range(2)]
    parts += [(0.0004 * n, 0.02, 1, 0.0, 1e8 * n, n) for n in (256, 384, 512, 768, 1024) for _ in range(2)]
    measured = [max(c / 0.5, m / 0.6) * slow.get(n, 1.0) + 0.004 + 0.001 * s for c, m, s, _, _, n in parts]
    got = dict(fit(measured, parts)[7])
    assert all(got[n] == pytest.approx(1.3, rel=0.1) for n in (32, 48, 64))
    spec = dataclasses.replace(TEST_DEVICE, token_factors=tuple(sorted(got.items())))
    assert spec.token_factor(40) == pytest.approx(1.3, rel=0.1)
    workloads = sweep(300)
    alone = {len(w[0].prompt) for w in workloads if len(w) == 1}
    batches = {len(w) for w in workloads}               # a decode of b sequences is b tokens too
    assert set(SHORT_PROMPTS) <= alone and not set(SHORT_PROMPTS) & batches


def test_few_token_prefills_off_the_line_leave_the_long_prompts_compute_efficiency():
    """Prefills of 20-128 tokens at 1.5x their bound (a GEMM of few rows; a third of the steps,
    as in torch's sweep here) get their factors, and the compute efficiency stays that of the
    steps past FACTOR_TOKENS, which no factor touches: a 512-token prompt is costed at its own
    time, not at a third more."""
    from twophase.simulate.fit import fit

    parts = [(0.002, 0.01 + 0.001 * i, 1, 1e6, 1e7, 1) for i in range(8)]
    parts += [(0.0004 * n, 0.02, 1, 0.0, 1e8 * n, n) for n in (256, 384, 512, 768, 1024) for _ in range(2)]
    parts += [(0.0004 * n, 0.012, 1, 0.0, 1e8 * n, n) for n in (20, 32, 48, 64, 96, 128) for _ in range(2)]
    measured = [max(c / 0.5, m / 0.6) * (1.5 if 1 < n <= 128 else 1.0) + 0.004 + 0.001 * s
                for c, m, s, _, _, n in parts]
    err, ec, *_ = fit(measured, parts)
    assert ec == 0.5 and err < 0.01


def test_a_steps_host_terms_count_its_sequences_and_the_kv_it_reads():
    from helpers.simulated import TEST_DEVICE

    from twophase.plan.model_source import planned_model
    from twophase.simulate.cost import StepCostModel

    arch = planned_model(load_config({"model": {"name": "tiny", "weights": "random"}}).model).arch
    plain = StepCostModel(arch, TEST_DEVICE, "float32", 4)
    host = StepCostModel(arch, dataclasses.replace(TEST_DEVICE, seq_overhead_s=1e-3, kv_byte_s=1e-9,
                                                   attention_flop_s=1e-12), "float32", 4)
    chunks = [(1, 300), (1, 50), (1, 10)]
    extra = host.step(chunks).seconds - plain.step(chunks).seconds
    assert extra == pytest.approx(3 * 1e-3 + 1e-9 * plain.kv_read(chunks) + 1e-12 * plain.attention_flops(chunks))
    # QK and PV over each decode's keys, its own new one included
    a = arch
    assert plain.attention_flops(chunks) == pytest.approx(4 * a.num_layers * a.num_heads * a.head_dim * (301 + 51 + 11))
    # a decode reads its context's K/V, its own new token's included, in every layer
    assert plain.kv_read(chunks) == pytest.approx((301 + 51 + 11) * arch.num_layers * plain.layer_kv_bytes)


def test_the_sweeps_prompts_join_running_decodes_and_take_the_same_steps_on_any_clock():
    """Served, a new prompt is prefilled beside the running decodes (most of its time to first
    token): the sweep's prompts of 64-256 tokens join decodes at every batch from 1 to 8 on the
    step they name, so a device ten times slower takes the same steps (the fit pairs step ``i``
    of the real run with step ``i`` of the simulated one)."""
    from helpers.simulated import TEST_DEVICE

    from twophase.simulate.engine import SimulatedLLM
    from twophase.simulate.fit import JOINING, run_steps, sweep

    def steps(device):
        out = []
        for reqs in sweep(300):
            sim = SimulatedLLM(tiny("torch"), device)
            sim.engine = sim.build_engine(clock=sim.clock)
            run_steps(sim.engine, reqs)
            out += [c.chunks for c in sorted((c for b in sim.backends for c in b.calls), key=lambda c: c.start)]
        return out

    fast = steps(TEST_DEVICE)
    assert steps(dataclasses.replace(TEST_DEVICE, peak_flops=2e10, bandwidth=4e9)) == fast
    joined = set()
    for chunks in fast:
        prompts = [n for n, depth in chunks if depth == 0 and n > 1]
        decodes = sum(1 for n, depth in chunks if n == 1 and depth > 0)
        if len(prompts) == 1 and decodes:
            joined.add((prompts[0], decodes))
    assert set(JOINING) <= {n for n, _ in joined}
    assert set(range(1, 9)) <= {b for _, b in joined}
