"""Several engines on one virtual timeline: replicas routed by the cluster's own prefix-affinity
rule, prefill workers handing K/V to decode workers through the engines' own connector, and
tensor parallelism's cost on paper."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.simulated import TEST_DEVICE, config

from twophase.bench.serving import TimedRequest, synthetic
from twophase.errors import ConfigError
from twophase.simulate import driver, fleet, simulate
from twophase.simulate.cost import StepCostModel
from twophase.simulate.devices import device_spec
from twophase.simulate.engine import SimulatedLLM
from twophase.simulate.report import SLO

H100 = device_spec("h100-80gb")


def test_one_replica_through_the_fleet_loop_steps_as_the_single_engine_driver():
    sections = dict(cache={"num_blocks": 40}, scheduler={"max_num_batched_tokens": 96, "admission": "greedy"})
    reqs = synthetic(24, 400.0, [40, 120], [20, 60], 512, seed=3)
    one = SimulatedLLM(config("tiny", **sections), TEST_DEVICE)
    alone = driver.drive(one.engine, reqs, one.clock, one.clock.sleep)
    f = fleet.Fleet(config("tiny", **sections), TEST_DEVICE)
    run = fleet.drive(f, reqs)
    assert sum(s.preemptions for s in f.steps) > 0            # the pool is short: preemption decides
    assert f.steps == list(one.engine.steps.records)
    assert [o.times for o in run.outputs] == [o.times for o in alone.outputs]
    assert run.queue == alone.queue


def _shared_prefixes(groups: int, per_group: int, prefix: int, tail: int, gap_s: float) -> list[TimedRequest]:
    """``groups`` system prompts of ``prefix`` tokens, each followed by its own ``tail``, the
    groups' requests interleaved ``gap_s`` apart."""
    out = []
    for i in range(per_group):
        for g in range(groups):
            prompt = [10 + g] * prefix + [100 + (i * groups + g) * 3 + k for k in range(tail)]
            out.append(TimedRequest(len(out) * gap_s, prompt, 32))
    return out


def _hit_rate(reqs) -> float:
    cfg = config("tiny", cluster={"replicas": 2})
    return simulate(cfg, TEST_DEVICE, reqs)["report"]["prefix_cache_hit_rate"]


def test_replicas_take_shared_prefixes_where_they_went_and_other_prompts_by_load(monkeypatch):
    reqs = _shared_prefixes(groups=2, per_group=8, prefix=96, tail=8, gap_s=0.005)
    affine = _hit_rate(reqs)
    real = fleet.pick
    monkeypatch.setattr(fleet, "pick", lambda w, load, m, i, tokens, bs: real(w, load, m, i, None, bs))
    by_load = _hit_rate(reqs)                                  # the router without its prefixes
    monkeypatch.undo()
    single = simulate(config("tiny"), TEST_DEVICE, reqs)["report"]["prefix_cache_hit_rate"]
    assert affine == pytest.approx(single, rel=0.05)           # each group's blocks on one replica
    assert affine > by_load + 0.1                              # alternating: each group on both
    distinct = synthetic(16, None, [64, 64], [8, 8], 512, seed=1)
    r = simulate(config("tiny", cluster={"replicas": 2}), TEST_DEVICE, distinct)["simulation"]
    assert [e["steps"] > 0 for e in r["engines"]] == [True, True]
    assert r["devices"] == 2


def test_disaggregated_workers_compute_each_prompt_once_and_pull_its_full_blocks():
    bs = 16
    reqs = synthetic(12, 50.0, [40, 120], [6, 12], 512, seed=2)
    slow = dataclasses.replace(TEST_DEVICE, link_bandwidth=2e6)   # a block's K/V takes ~4 ms
    f = fleet.Fleet(config("tiny", cluster={"prefill_workers": 1, "decode_workers": 1}), slow)
    run = fleet.drive(f, reqs)
    (p,), (d,) = f.by_role("prefill"), f.by_role("decode")
    prefill_tokens = [sum(s.prefill_tokens for s in m.llm.engine.steps.records) for m in (p, d)]
    full = [(len(r.prompt) - 1) // bs * bs for r in reqs]
    assert prefill_tokens[0] == sum(len(r.prompt) for r in reqs)          # every prompt once
    # the decode side computes what the full blocks do not hold: the partial block and the first token
    assert prefill_tokens[1] == sum(len(r.prompt) + 1 - n for r, n in zip(reqs, full))
    pulls = list(d.connector.transfers)
    block_bytes = d.llm.kv_cache.pool[:, :, :1].numel() * d.llm.kv_cache.pool.element_size()
    assert sorted(n for n, _, _ in pulls) == sorted(full)
    assert sum(b for _, b, _ in pulls) == sum(full) // bs * block_bytes
    firsts = {s.start + s.duration for s in p.llm.engine.steps.records}
    cost = d.llm.prefill_backend.cost
    for r, o, n in zip(reqs, run.outputs, full):
        t = o.times
        assert len(o.token_ids) == len(t.token_times) == r.max_tokens      # both sides' tokens
        assert t.arrival == pytest.approx(r.offset_s) and t.token_times[0] in firsts
        # the second token waits for the blocks to cross the link
        assert t.token_times[1] - t.token_times[0] >= cost.transfer_s(n // bs * block_bytes) > 0.005
    assert p.connector.num_leased_blocks == 0                            # every lease acknowledged


def test_disaggregation_needs_workers_of_both_roles_and_a_link():
    with pytest.raises(ConfigError, match="prefill_workers and decode_workers"):
        fleet.Fleet(config("tiny", cluster={"prefill_workers": 1}), TEST_DEVICE)
    gemma = config("gemma3-270m", cluster={"prefill_workers": 1, "decode_workers": 1})
    with pytest.raises(ConfigError, match="workers cannot serve .*groups of layers"):
        fleet.Fleet(gemma, TEST_DEVICE)          # sliding and full layers' K/V do not move
    with pytest.raises(ConfigError, match="--link-gbps"):
        fleet.Fleet(config("tiny", cluster={"prefill_workers": 1, "decode_workers": 1}),
                    dataclasses.replace(TEST_DEVICE, link_bandwidth=0.0))


def test_tensor_parallelism_splits_a_step_and_adds_two_all_reduces_a_layer():
    from twophase.plan.model_source import planned_model

    arch = planned_model(config().model).arch
    one, two = (StepCostModel(arch, H100, "bfloat16", 2, tp) for tp in (1, 2))
    batch = [(1, 1000)] * 8
    a, b = one.step(batch), two.step(batch)
    assert b.memory_s == pytest.approx(a.memory_s / 2) and b.compute_s == pytest.approx(a.compute_s / 2)
    ring = (2 * (2 - 1) / 2) * 8 * arch.hidden_size * 2 / (H100.link_bandwidth * H100.link_efficiency)
    assert b.comm_s == pytest.approx(2 * arch.num_layers * (ring + H100.link_latency_s))
    assert a.comm_s == 0 and b.seconds == pytest.approx(max(b.compute_s, b.memory_s) + b.comm_s
                                                         + H100.step_overhead_s)
    # the weights are read once over two devices' memory: more than twice the pool
    blocks = [SimulatedLLM(config(), H100, tp=tp).num_blocks for tp in (1, 2)]
    assert blocks[1] > 2 * blocks[0]
    with pytest.raises(ConfigError, match="--tp"):
        SimulatedLLM(config("tiny"), TEST_DEVICE, tp=2)


def test_disaggregation_meets_a_tight_tpot_slo_that_colocated_replicas_miss():
    """DistServe's finding on the same two GPUs: with long prompts arriving while others decode,
    colocated replicas stall decodes behind prefill chunks; one prefill and one decode worker keep
    TPOT low, so more requests meet the SLO, while raw throughput does not rise."""
    reqs = synthetic(200, 8.0, [1000, 3000], [100, 300], 32000, seed=0)
    slo = SLO(ttft_s=1.0, tpot_s=0.015)
    colocated = simulate(config(cluster={"replicas": 2}), H100, reqs, slo)
    split = simulate(config(cluster={"prefill_workers": 1, "decode_workers": 1}), H100, reqs, slo)
    good = [r["simulation"]["goodput"] for r in (colocated, split)]
    assert good[1]["attainment"] > good[0]["attainment"] + 0.05
    assert split["report"]["tpot_s"]["p90"] < colocated["report"]["tpot_s"]["p90"]
    tput = [r["report"]["output_tokens_per_s"] for r in (colocated, split)]
    assert tput[1] <= tput[0] * 1.01
