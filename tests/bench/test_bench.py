"""``twophase bench``: its figures come from measured events (checked exactly on a fake clock),
its roofline from a hand-countable cost model, and a run on the tiny model writes every
artefact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.models import tiny_llm

from twophase.bench import serving
from twophase.bench.roofline import CostModel
from twophase.models.families.llama import arch as llama_arch
from twophase.models.shapes import named_shape


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


def test_serving_figures_from_a_fake_clock_are_exact():
    """Each step takes exactly 10 ms of fake time. Request 0 arrives at 0, request 1 at 15 ms
    while request 0 decodes; each wants 3 tokens."""
    llm = tiny_llm()
    clock = FakeClock()
    engine = llm.build_engine(clock=clock)
    step = engine.step

    def timed_step():
        clock.t += 0.010
        return step()

    engine.step = timed_step
    reqs = [serving.TimedRequest(0.0, list(range(5, 25)), 3),
            serving.TimedRequest(0.015, list(range(30, 42)), 3)]
    res = serving.run(engine, reqs, clock=clock, sleep=clock.sleep)
    # req 0: tokens at 10, 20, 30 ms; req 1 added at 20 ms (arrived 15), tokens at 30, 40, 50
    assert res["wall_s"] == pytest.approx(0.050)
    assert res["output_tokens"] == 6 and res["output_tokens_per_s"] == pytest.approx(120)
    assert res["request_throughput"] == pytest.approx(40)
    assert sorted(res["ttft_values"]) == pytest.approx([0.010, 0.015])
    assert res["ttft_s"]["mean"] == pytest.approx(0.0125)
    assert res["ttft_s"]["p50"] == pytest.approx(0.0125)
    assert res["ttft_s"]["p90"] == pytest.approx(0.0145)
    assert res["ttft_s"]["p99"] == pytest.approx(0.01495)
    assert res["itl_values"] == pytest.approx([0.010] * 4)
    assert res["tpot_s"]["p99"] == pytest.approx(0.010)
    assert res["e2e_s"]["p50"] == pytest.approx(0.0325)       # 30 ms and 35 ms
    assert res["max_decode_batch"] == 1


def test_poisson_arrivals_follow_the_rate():
    reqs = serving.synthetic(2000, 4.0, [1, 4], [1, 2], 100, seed=1)
    gaps = [b.offset_s - a.offset_s for a, b in zip(reqs, reqs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)
    assert all(g >= 0 for g in gaps)
    assert {r.offset_s for r in serving.synthetic(5, None, [1, 4], [1, 2], 100)} == {0.0}


TOY = llama_arch(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=4)


def test_cost_model_matches_a_hand_count():
    cost = CostModel(TOY, weight_bytes=4, kv_bytes=4)
    # per layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16  = 64+64+64+384
    assert cost.layer_params == 576 and cost.head_params == 80
    # prefill of 3 tokens, nothing cached: 2*3*1152 linear + 2*80 head (last token only)
    # + attention 4 * L(2) * H(2) * hd(4) * (1+2+3 keys seen) = 384
    p = cost.prefill(3)
    assert p.flops == 6912 + 160 + 384
    kv_per_token = 2 * 2 * 1 * 4 * 4                         # L * (K,V) * KVH * hd * 4 bytes
    assert cost.kv_bytes_per_token == kv_per_token == 64
    assert p.bytes == (1152 + 80) * 4 + 3 * kv_per_token
    # decode of 2 sequences with 5 cached tokens: each token sees 6 keys
    d = cost.decode(2, 5)
    assert d.flops == 2 * (2 * 1232 + 4 * 2 * 2 * 4 * 6)
    assert d.bytes == 1232 * 4 + 2 * 6 * kv_per_token
    assert d.bound_s(1e3, 1e2) == max(d.flops / 1e3, d.bytes / 1e2)


def test_sweeps_leave_out_what_the_context_cannot_take_and_never_hit_the_prefix_cache(one_torch_thread):
    from twophase.bench import sweeps
    from twophase.config import BenchConfig
    from twophase.errors import ConfigError

    b, notes = sweeps.servable(BenchConfig(), 2048)              # the defaults reach 2,048
    assert b.prompt_lens == [128, 256, 512, 1024] and len(notes) == 1 and "prefill 2048" in notes[0]
    with pytest.raises(ConfigError, match="bench.prompt_lens"):
        sweeps.servable(BenchConfig(prompt_lens=[4096]), 2048)
    with pytest.raises(ConfigError, match="bench.decode_context"):
        sweeps.servable(BenchConfig(decode_context=2047), 2048)
    # on a 512-token vocabulary, after the decode sweep's contexts are cached, every prefill
    # prompt of every round is computed, none found cached
    from twophase.bench.run import _bench_llm
    from twophase.config import load_config

    llm = _bench_llm(load_config({"model": {"name": "tiny", "weights": "random"},
                                  "bench": {"prompt_lens": b.prompt_lens}}), "torch")
    for batch in b.batch_sizes:
        sweeps.decode_round(llm, batch, b.decode_context, b.decode_steps, 0)
    hits = llm.engine.kv.hits
    for salt in range(3):
        for n in b.prompt_lens:
            assert sweeps.prefill_round(llm, n, 0, salt) > 0
    assert llm.engine.kv.hits == hits


def test_hf_decode_is_timed_step_by_step_never_as_a_difference(one_torch_thread, monkeypatch):
    """A decode step is the gap between two tokens reaching generate's streamer (a difference
    of two generate calls once came out negative at batch 32, reported as 0.0 ms)."""
    from twophase.bench.hf_baseline import HFBaseline, _TokenClock

    clock = _TokenClock()
    clock.times = [0.0, 5.0, 5.1, 5.3, 5.4, 5.6]      # prompt, prefill's token, 4 decode steps
    assert clock.decode_step_s(4) == pytest.approx(0.2)        # median of .2 .1 .2 (the first left out)
    with pytest.raises(RuntimeError, match="4 decode steps timed, expected 5"):
        clock.decode_step_s(5)
    puts = []
    monkeypatch.setattr(_TokenClock, "put", lambda self, v: puts.append(v.shape) or self.times.append(len(puts)))
    step = HFBaseline(tiny_llm()).decode_round(32, 24, 4, 0)
    assert step == 1.0                                 # one fake second between puts
    assert puts[0] == (32, 24) and puts[1:] == [(32,)] * 5


def test_a_verify_pass_is_decode_for_each_of_its_tokens_over_one_weight_read():
    cost = CostModel(TOY, weight_bytes=4, kv_bytes=4)
    one = cost.verify(1, 5, 1)
    assert (one.flops, one.bytes) == (cost.decode(1, 5).flops, cost.decode(1, 5).bytes)
    # 3 tokens after 5 cached: they see 6, 7 and 8 keys; one read of the weights
    v = cost.verify(1, 5, 3)
    assert v.flops == 3 * 2 * 1232 + 4 * 2 * 2 * 4 * (6 + 7 + 8)
    assert v.bytes == 1232 * 4 + 8 * 64
    got = cost.speculative_intensity(5, {"draft_tokens": 20, "verify_passes": 10,
                                         "mean_accepted_length": 2.5})
    assert got["tokens_computed_per_pass"] == 3 and got["verify_intensity_b1"] == v.intensity
    assert got["decode_intensity_b1"] < got["kept_intensity_b1"] < got["verify_intensity_b1"]
    assert got["kept_intensity_b1"] == pytest.approx(v.intensity * 2.5 / 3)


def test_roofline_of_an_8b_model_on_an_h200_matches_the_known_bounds():
    """An 8B bf16 model holds 16.06 GB of weights, but a decode step reads 15.0 of them: the
    embedding table is read only at the batch's rows, so 3.5 ms at 4.3 TB/s, not the 3.7 ms of
    all 16 GB. A 2048-token prefill is 2 x 2048 x 8.03e9 = 33 TFLOP counted naively (42 ms at
    790 TFLOP/s), but the engine computes logits for the last token only and the embedding is a
    lookup: 28.6 TFLOP of projections + 1.1 of causal attention = 29.7 TFLOP, 37.6 ms."""
    arch = named_shape("llama3-8b")
    cost = CostModel(arch, weight_bytes=2, kv_bytes=2)
    embedding = arch.vocab_size * arch.hidden_size * 2
    d = cost.decode(1, 0)
    assert d.bytes + embedding == pytest.approx(16.06e9, rel=0.01)
    assert d.bound_s(790e12, 4.3e12) * 1e3 == pytest.approx(3.5, abs=0.05)
    p = cost.prefill(2048)
    naive = 2 * 2048 * (d.bytes + embedding) / 2
    assert naive == pytest.approx(32.9e12, rel=0.01)
    assert p.flops == pytest.approx(29.7e12, rel=0.01)
    assert p.bound_s(790e12, 4.3e12) * 1e3 == pytest.approx(37.6, abs=0.3)
    cross = cost.decode_crossover(0, 790e12, 4.3e12)
    assert cost.decode(cross, 0).intensity >= 790 / 4.3 > cost.decode(cross - 1, 0).intensity


def test_bench_on_the_tiny_model_writes_every_artefact(tmp_path, seed_calibration):
    # ceilings far below anything the model runs at: every figure beats its roofline bound
    seed_calibration(peak_flops=1e6, bandwidth=1e6)
    cfg = tmp_path / "bench.toml"
    cfg.write_text("""
[model]
name = "tiny"
weights = "random"

[bench]
backends = ["torch"]
prompt_lens = [16, 48]
batch_sizes = [1, 4]
decode_context = 24
decode_steps = 3
repeats = 3

[bench.serving]
num_requests = 6
input_len = [8, 24]
output_len = [3, 8]
rate = 100
""")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "twophase", "bench", str(cfg), "--out", str(out),
                          "--compare-chunked", "--speculative"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "COLUMNS": "80"})
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("results.json", "report.md", "prefill_tokens_per_s.png",
                 "decode_tokens_per_s.png", "ttft_itl.png", "chunked_itl.png"):
        assert (out / name).stat().st_size > 100, name
    res = json.loads((out / "results.json").read_text())
    assert res["lines"] == ["torch", "hf"]
    spec = res["serving"]["torch, speculative ngram k=auto"]         # beside the same workload
    assert spec["output_tokens"] == res["serving"]["torch"]["output_tokens"]
    assert "speculative ngram" in (out / "report.md").read_text()
    assert res["repeats"] == 3
    assert res["torch_threads"] == 1                                   # a small model: one thread
    for phase, shapes in (("prefill", [16, 48]), ("decode", [1, 4])):
        for line in res["lines"]:
            got = res[phase][line]
            assert sorted(map(int, got)) == shapes
            assert all(m["rounds"] == 3 and m["min_s"] <= m["median_s"] <= m["max_s"]
                       and m["roofline_fraction"] > 1 for m in got.values())
    assert isinstance(res["outliers"], list)
    assert {"load_before", "load_after", "steal_fraction", "others_cpu_fraction"} <= set(res["machine"])
    assert res["serving"]["torch"]["requests"] == 6 and res["serving"]["torch"]["ttft_s"]["p99"] > 0
    assert set(res["chunked"]) == {"on", "off"}
    for s in res["chunked"].values():
        at = s["itl_timeline_at_s"]
        assert at == sorted(at) and len(at) == len(s["itl_timeline"])
        assert 0 < s["long_prompt_arrival_s"] < s["long_prompt_first_token_s"]
    assert res["ceilings"]["peak_flops"] == 1e6                        # the seeded entry, not a new one
    assert "decode: tokens/s" in run.stdout and "serving" in run.stdout
    words = " ".join(run.stdout.split())                              # as wrapped at 80 columns
    assert "Measured above the roofline bound" in words and "twophase calibrate --force" in words
    assert all(len(line) <= 80 for line in run.stdout.splitlines()) and "…" not in run.stdout
    # not a terminal: one log line a phase instead of a progress bar
    logged = [line for line in run.stderr.splitlines() if "bench [" in line]
    assert len(logged) == 1 + 3 + 2 + 1 + 2, logged       # warm-up, rounds, serving, speculative, chunked
    for phase, line in zip(("warm-up", "round 1/3", "round 3/3", "serving workload on hf",
                            "chunked prefill off"), [logged[i] for i in (0, 1, 3, 5, 8)]):
        assert phase in line, (phase, line)
    md = (out / "report.md").read_text()
    assert "| 48 | torch |" in md and "![decode_tokens_per_s](decode_tokens_per_s.png)" in md
    assert "## Warnings" in md and "twophase calibrate --force" in md


@pytest.mark.parametrize("bench, message", [
    ({"cache_depth": 5}, "bench.cache_depth: must be a multiple of cache.block_size"),
    ({"serving": {"rate": 0}}, "bench.serving.rate: must be a positive number"),
    ({"batch_sizes": []}, "bench.batch_sizes: must be a non-empty list"),
    ({"repeats": 2}, "bench.repeats: must be at least 3"),
])
def test_bad_bench_config_is_one_clear_line(tmp_path, bench, message):
    from twophase.config import load_config
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config({"bench": bench})
    assert str(info.value).startswith(message)


def test_unknown_backend_in_bench_is_a_config_error(tmp_path):
    cfg = tmp_path / "b.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\n')
    run = subprocess.run([sys.executable, "-m", "twophase", "bench", str(cfg), "--backends",
                          "torch,nosuch"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "nosuch" in run.stderr and "Traceback" not in run.stderr


def test_calibrate_refuses_a_device_it_cannot_measure():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    run = subprocess.run([sys.executable, "-m", "twophase", "calibrate", "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "sees no CUDA device" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_pool_too_small_for_the_decode_batch_says_which_key_to_raise():
    from twophase.errors import ConfigError
    from twophase.measure.phase_timing import decode_round

    llm = tiny_llm(cache={"num_blocks": 16, "block_size": 4})       # 64 tokens: 8 x 32 cannot fit
    with pytest.raises(ConfigError, match="raise cache.num_blocks"):
        decode_round(llm, batch=8, context=32, steps=2, salt=0)
    assert decode_round(tiny_llm(), batch=2, context=32, steps=2, salt=0) > 0
