"""The cost model against figures computed by hand from Llama 3 8B's published shape."""

from __future__ import annotations

from dataclasses import replace

import pytest

from twophase.bench.roofline import CostModel
from twophase.models.shapes import SHAPES
from twophase.simulate.cost import StepCostModel
from twophase.simulate.devices import device_spec

ARCH = SHAPES["llama3-8b"]
L, H, KV, HD, D, F, V = 32, 32, 8, 128, 4096, 14336, 128256
LAYER = D * H * HD + 2 * D * KV * HD + H * HD * D + 3 * D * F      # q, k, v, o, gate/up/down
WEIGHTS = (L * LAYER + V * D) * 2                                   # bf16, untied head read once
KV_TOKEN = L * 2 * KV * HD * 2


def model(device: str = "h100-80gb") -> StepCostModel:
    return StepCostModel(ARCH, device_spec(device, "bfloat16"), "bfloat16", 2)


def test_the_shape_is_the_one_computed_by_hand():
    assert (ARCH.num_layers, ARCH.num_heads, ARCH.num_kv_heads, ARCH.head_dim) == (L, H, KV, HD)
    assert model().weight_bytes == pytest.approx(WEIGHTS)         # ~15.0 GB
    assert WEIGHTS == pytest.approx(15.0e9, rel=0.01)


def test_decode_at_batch_one_is_the_weights_read_at_the_bandwidth():
    c = model().step([(1, 1023)])
    moved = WEIGHTS + 1024 * KV_TOKEN
    assert c.bytes == pytest.approx(moved)
    assert c.memory_s == pytest.approx(moved / (3.35e12 * 0.8))    # ~5.6 ms
    assert c.bound == "memory"
    assert c.seconds == pytest.approx(c.memory_s + 1e-3)
    assert c.prefill_flops == 0 and c.decode_flops > 0


def test_a_long_prefill_chunk_is_compute_bound_with_its_quadratic_attention():
    n = 4096
    c = model().step([(n, 0)])
    flops = 2 * n * L * LAYER + 2 * V * D + 4 * L * H * HD * n * (n + 1) / 2
    assert c.flops == pytest.approx(flops)
    assert c.compute_s == pytest.approx(flops / (989e12 * 0.55))   # ~0.13 s
    assert c.bound == "compute" and c.seconds == pytest.approx(c.compute_s + 1e-3)


def test_a_chunk_costs_what_the_roofline_says():
    roof = CostModel(ARCH, 2, 2)
    for n, d in ((1, 0), (17, 300), (512, 2048)):
        assert model().chunk_flops(n, d) == pytest.approx(roof.prefill(n, d).flops)


def test_a_mixed_step_reads_the_weights_once_and_splits_them_by_tokens():
    c = model().step([(300, 0), (1, 99), (1, 199)])
    assert c.bytes == pytest.approx(WEIGHTS + (300 + 100 + 200) * KV_TOKEN)
    assert c.decode_bytes == pytest.approx(WEIGHTS * 2 / 302 + 300 * KV_TOKEN)


def test_h200_decodes_faster_than_h100_by_its_bandwidth():
    h100, h200 = model("h100-80gb").step([(1, 0)] * 8), model("h200").step([(1, 0)] * 8)
    assert h100.memory_s / h200.memory_s == pytest.approx(4.8 / 3.35)


def test_a_windows_pairs_are_the_queries_keys_counted_one_by_one():
    from twophase.bench.roofline import _pairs

    for window in (0, 1, 5, 16):
        for depth in (0, 3, 15, 40):
            for n in (1, 4, 16, 33):
                counted = sum(min(p + 1, window) if window else p + 1 for p in range(depth, depth + n))
                assert _pairs(n, depth, window) == counted, (n, depth, window)


def test_sliding_layers_read_and_attend_to_their_window_only():
    """Gemma 3 27B (five sliding layers of 1,024 in six): a decode at 8K context reads the
    global layers' 8K keys and the sliding ones' 1,024, so far less K/V than were every layer
    global; prefill's attention likewise."""

    arch = SHAPES["gemma3-27b"]
    windows = [s.attention.window for s in arch.layers]
    sliding, full = sum(1 for w in windows if w), sum(1 for w in windows if not w)
    assert sliding == 52 and full == 10 and set(windows) == {None, 1024}
    cost = StepCostModel(arch, device_spec("h200", "bfloat16"), "bfloat16", 2)
    every = StepCostModel(replace(arch, layers=tuple(replace(s, attention=replace(s.attention, window=None))
                                                         for s in arch.layers)), device_spec("h200", "bfloat16"),
                          "bfloat16", 2)
    per_layer = 2 * arch.num_kv_heads * arch.head_dim * 2
    c = cost.step([(1, 8191)])
    assert c.bytes == pytest.approx(cost.weight_bytes + (full * 8192 + sliding * 1024) * per_layer)
    assert every.step([(1, 8191)]).bytes == pytest.approx(cost.weight_bytes + 62 * 8192 * per_layer)
    pairs = full * 4096 * 4097 / 2 + sliding * (1024 * 1025 / 2 + (4096 - 1024) * 1024)
    saved = cost._attention * (62 * 4096 * 4097 / 2 - pairs)
    assert every.chunk_flops(4096, 0) - cost.chunk_flops(4096, 0) == pytest.approx(saved)


def test_a_fitted_token_factor_scales_only_the_bound_of_a_step_of_that_many_tokens():
    device = device_spec("h100-80gb", "bfloat16")
    slow = replace(device, token_factors=((2, 2.0),))
    plain, factored = (StepCostModel(ARCH, d, "bfloat16", 2) for d in (device, slow))
    two, three = [(1, 100), (1, 200)], [(1, 100), (1, 200), (1, 300)]
    a, b = plain.step(two), factored.step(two)
    assert b.seconds - b.comm_s == pytest.approx(2 * max(a.compute_s, a.memory_s) + device.step_overhead_s)
    assert factored.step(three).seconds == plain.step(three).seconds      # past the last count: 1
