"""The simulator runs the engine's own scheduler: its batching, limits, admission and
preemption show in the simulated steps, and the simulated engine steps as LLM's engine does."""

from __future__ import annotations

import json

import pytest
from helpers.simulated import TEST_DEVICE, config

from twophase.backends.registry import BackendInfo, Registry
from twophase.bench.serving import TimedRequest, synthetic
from twophase.core.scheduler import Scheduler
from twophase.llm import LLM
from twophase.simulate import driver, simulate
from twophase.simulate.backend import SimulatedBackend
from twophase.simulate.cost import StepCostModel
from twophase.simulate.devices import device_spec
from twophase.simulate.engine import SimulatedLLM
from twophase.simulate.report import SLO, parse_slo

H100 = device_spec("h100-80gb")


def requests(n: int, rate: float | None, prompt=(64, 256), output=(16, 32), seed: int = 0) -> list[TimedRequest]:
    return synthetic(n, rate, list(prompt), list(output), 32000, seed)


def test_a_rate_far_above_capacity_grows_the_queue_its_ttft_and_preempts():
    cfg = config(model={"max_model_len": 512}, cache={"num_blocks": 40},
                 scheduler={"admission": "greedy"})
    over = simulate(cfg, H100, requests(30, 2000.0, (200, 400), (60, 100)))
    under = simulate(cfg, H100, requests(30, 0.5, (200, 400), (60, 100)))
    ttft = over["simulation"]["ttft_values"]
    assert over["report"]["preemptions"] > 0 and under["report"]["preemptions"] == 0
    assert sum(ttft[-10:]) / 10 > 5 * sum(ttft[:10]) / 10        # later arrivals wait longer
    assert over["report"]["ttft_s"]["p50"] > 10 * under["report"]["ttft_s"]["p50"]
    assert max(p["kv_occupancy"] for p in over["simulation"]["timeline"]) > 0.9
    assert max(p["waiting"] for p in over["simulation"]["timeline"]) > 20
    assert max(p["waiting"] for p in under["simulation"]["timeline"]) <= 2


def test_the_token_budget_sets_prefill_batching_as_the_scheduler_does():
    reqs = requests(16, None, (700, 700), (4, 4))
    small = SimulatedLLM(config(scheduler={"max_num_batched_tokens": 256}), H100)
    large = SimulatedLLM(config(scheduler={"max_num_batched_tokens": 2048}), H100)
    for llm in (small, large):
        driver.drive(llm.engine, reqs, llm.clock, llm.clock.sleep)
    chunks = [max(n for c in llm.prefill_backend.calls for n, _ in c.chunks) for llm in (small, large)]
    per_step = [max(s.prefill_tokens for s in llm.engine.steps.records) for llm in (small, large)]
    assert per_step == [256, 2048]
    assert chunks == [256, 700]                  # chunked at the budget; whole prompts fit the larger
    steps = [sum(s.prefill_tokens > 0 for s in llm.engine.steps.records) for llm in (small, large)]
    assert steps[0] >= 16 * 700 // 256 and steps[1] <= 16 * 700 // 2048 + 2


def test_max_num_seqs_bounds_every_decode_batch_and_queues_the_rest():
    r = simulate(config(scheduler={"max_num_seqs": 3}), H100, requests(9, None, (32, 32), (20, 20)))
    steps = [s for s in r["report"]["steps_by_mix"].values()]
    assert steps
    tl = r["simulation"]["timeline"]
    assert max(p["running"] for p in tl) == 3 and tl[0]["waiting"] == 6
    ttft = sorted(r["simulation"]["ttft_values"])
    assert ttft[3] > ttft[2] + 19 * r["report"]["tpot_s"]["p50"] * 0.9   # the fourth waits out the first three


def test_the_driver_steps_the_engines_own_scheduler(monkeypatch):
    calls = []
    real = Scheduler.schedule

    def spy(self, now=None):
        out = real(self, now)
        calls.append((now, len(out.decodes), out.num_prefill_tokens))
        return out

    monkeypatch.setattr(Scheduler, "schedule", spy)
    llm = SimulatedLLM(config(), H100)
    run = driver.drive(llm.engine, requests(8, 50.0), llm.clock, llm.clock.sleep)
    steps = list(llm.engine.steps.records)
    assert len(run.outputs) == 8 and steps
    assert [(c[1], c[2]) for c in calls if c[1] or c[2]] == [(s.decode_seqs, s.prefill_tokens) for s in steps]
    assert [c[0] for c in calls if c[1] or c[2]] == [s.start for s in steps]    # on the virtual clock


def _real_engine_over_simulated_backend(cfg):
    """LLM's own load (model, plan, pool, scheduler) with the simulated backend by name."""
    registry = Registry()
    registry.backends["simulated"] = BackendInfo("simulated", "tests", SimulatedBackend)
    llm = LLM(cfg, registry)
    backend = llm.prefill_backend
    backend.cost = StepCostModel(llm.model.arch, TEST_DEVICE, "float32", 4)
    llm.engine.clock = backend.clock
    return llm, backend


def test_simulate_and_the_real_engine_over_the_same_backend_make_identical_steps():
    sections = dict(cache={"num_blocks": 40}, scheduler={"max_num_batched_tokens": 96, "admission": "greedy"})
    reqs = synthetic(24, 400.0, [40, 120], [20, 60], 512, seed=3)
    real, backend = _real_engine_over_simulated_backend(config("tiny", backend={"name": "simulated"}, **sections))
    run = driver.drive(real.engine, reqs, backend.clock, backend.clock.sleep)
    sim = SimulatedLLM(config("tiny", **sections), TEST_DEVICE)
    sim_run = driver.drive(sim.engine, reqs, sim.clock, sim.clock.sleep)
    a, b = list(real.engine.steps.records), list(sim.engine.steps.records)
    assert sum(s.preemptions for s in a) > 0                  # the pool is short: preemption decides
    assert a == b                                             # every step: its tokens, blocks, times
    assert [c.chunks for c in backend.calls] == [c.chunks for c in sim.prefill_backend.calls]
    assert [o.token_ids for o in run.outputs] == [o.token_ids for o in sim_run.outputs]
    assert set(real.report(run.outputs)) == set(sim.report(sim_run.outputs))


def test_the_report_has_llm_reports_keys_and_goodput():
    real, backend = _real_engine_over_simulated_backend(config("tiny", backend={"name": "simulated"}))
    outputs = real.generate([[5, 6, 7, 8]] * 2)
    expected = set(real.report(outputs))
    r = simulate(config("tiny"), TEST_DEVICE, synthetic(6, None, [8, 16], [4, 8], 512), parse_slo("ttft=1,tpot=1"))
    assert set(r["report"]) == expected
    g = r["simulation"]["goodput"]
    assert g["attainment"] == 1.0 and g["goodput_rps"] == pytest.approx(6 / r["report"]["wall_s"])
    strict = simulate(config("tiny"), TEST_DEVICE, synthetic(6, None, [8, 16], [4, 8], 512), SLO(ttft_s=1e-9))
    assert strict["simulation"]["goodput"]["goodput_rps"] == 0
    json.dumps(r, default=str)


def test_an_idle_engine_jumps_to_the_next_arrival():
    reqs = [TimedRequest(0.0, [5] * 32, 4), TimedRequest(100.0, [6] * 32, 4)]
    r = simulate(config("tiny"), TEST_DEVICE, reqs)
    assert r["report"]["wall_s"] == pytest.approx(100.0, abs=0.5)
    assert r["simulation"]["host_s"] < 1.0
    ttft = r["simulation"]["ttft_values"]
    assert ttft[1] == pytest.approx(ttft[0], rel=0.2)         # measured from its own arrival


def test_speculation_keeps_what_the_engines_verification_keeps_at_the_workloads_rate():
    """Drafts kept at rate a: a mean run of 1 + a + ... + a^k tokens a verify pass (k = 4), and a
    TPOT that falls as a rises (at 0 the verify pass only costs)."""
    spec = {"speculative": {"method": "ngram", "num_tokens": 4}}
    reqs = requests(24, 20.0, (64, 128), (48, 64))
    plain = simulate(config(), H100, reqs)["report"]["tpot_s"]["p50"]
    runs = {a: simulate(config(**spec), H100, reqs, acceptance=a)["report"] for a in (0.0, 0.5, 0.9)}
    assert runs[0.0]["speculative"]["accepted_tokens"] == 0
    assert runs[0.5]["speculative"]["mean_accepted_length"] == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625, rel=0.1)
    assert runs[0.5]["speculative"]["acceptance_by_position"][0] == pytest.approx(0.5, abs=0.1)
    tpot = {a: r["tpot_s"]["p50"] for a, r in runs.items()}
    assert tpot[0.0] > plain > tpot[0.5] > tpot[0.9]
