"""Engine behaviour on the tiny random shape through the real torch backend."""

from __future__ import annotations

import random

import pytest
from helpers.models import tiny_llm

from twophase import SamplingParams
from twophase.models.param_counts import num_params
from twophase.testing import assert_greedy_match


def _gaps(out) -> list[float]:
    """Top-2 logit gaps from logprobs=2 (log-softmax keeps differences of logits)."""
    gaps = []
    for lp in out.logprobs:
        top = sorted(lp.values(), reverse=True)
        gaps.append(top[0] - top[1])
    return gaps


def test_batch_with_preemption_and_chunking_gives_each_request_its_alone_tokens():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(32)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    llm = tiny_llm(cache={"num_blocks": 40, "block_size": 4},
                   scheduler={"max_num_batched_tokens": 48, "max_num_seqs": 16})
    alone = [llm.generate([p], params)[0] for p in prompts]
    llm.reset_stats()
    together = llm.generate(prompts, params)
    rep = llm.report(together)
    assert rep["preemptions"] > 0, "the pool was meant to be small enough to force preemption"
    assert rep["steps_by_mix"].get("mixed"), "decodes were meant to ride along prefill chunks"
    assert any(o.metrics["num_preemptions"] for o in together)
    for i, (a, t) in enumerate(zip(alone, together)):
        assert_greedy_match(t.token_ids, a.token_ids, _gaps(a), f"prompt {i}")
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def test_prefix_cache_hits_give_the_same_tokens_as_misses():
    prefix = list(range(10, 60))
    prompts = [prefix + [100 + i] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cold = tiny_llm(cache={"prefix_caching": False}).generate(prompts, params)
    llm = tiny_llm()
    warm = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert all(o.metrics["num_cached_tokens"] == 48 for o in warm[1:])
    assert llm.engine.kv.hit_rate > 0


def test_policies_and_unchunked_prefill_agree():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 90))] for _ in range(8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    base = [o.token_ids for o in tiny_llm().generate(prompts, params)]
    for sched in ({"policy": "prefill-first"}, {"chunked_prefill": False},
                  {"max_num_batched_tokens": 17, "max_num_seqs": 4}):
        assert [o.token_ids for o in tiny_llm(scheduler=sched).generate(prompts, params)] == base, sched


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    llm = tiny_llm()
    p = [5, 6, 7]
    a = llm.generate([p, p], [SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True)] * 2)
    b = llm.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    c = llm.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True))
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    assert c[0].token_ids != b[0].token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy():
    llm = tiny_llm()
    p = [9, 8, 7, 6]
    greedy = llm.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = llm.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8,
                                               seed=3, **kw))[0]
        assert out.token_ids == greedy, kw


def test_penalties_change_greedy_output():
    llm = tiny_llm()
    p = [9, 8, 7, 6]
    base = llm.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    pen = llm.generate([p], SamplingParams(max_tokens=24, ignore_eos=True,
                                           frequency_penalty=2.0, presence_penalty=2.0))[0].token_ids
    assert pen != base
    assert len(set(pen)) >= len(set(base))


def test_stop_token_ids_min_tokens_and_max_tokens():
    llm = tiny_llm()
    p = [11, 12, 13]
    free = llm.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate([p], SamplingParams(max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    late = llm.generate([p], SamplingParams(max_tokens=20, min_tokens=20, stop_token_ids=[stop_at]))[0]
    assert late.finish_reason == "length" and len(late.token_ids) == 20
    assert stop_at not in late.token_ids


def test_logprobs_are_normalised_and_include_the_sampled_token():
    llm = tiny_llm()
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3          # greedy: the sampled token is the top one
        assert max(lp.values()) == pytest.approx(lp[tok])
        assert all(v <= 0 for v in lp.values())


def test_incremental_api_streams_deltas_and_abort_frees_blocks():
    llm = tiny_llm()
    eng = llm.engine
    a = eng.add_request([5, 6, 7] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request("hello", SamplingParams(max_tokens=4, ignore_eos=True))
    seen: dict[str, list[int]] = {a.request_id: [], b.request_id: []}
    for _ in range(3):
        for d in eng.step():
            seen[d.request_id] += d.token_ids
    assert seen[a.request_id] and eng.kv.num_used_blocks > 0
    assert eng.abort(a.request_id)
    while eng.has_unfinished():
        for d in eng.step():
            seen[d.request_id] += d.token_ids
    assert a.finish_reason == "abort" and b.finish_reason == "length"
    assert seen[b.request_id] == b.output_token_ids and len(seen[b.request_id]) == 4
    assert eng.kv.num_free_blocks == llm.num_blocks


def test_min_p_then_top_p_renormalises():
    import torch

    from twophase.core.request import Request
    from twophase.core.sampler import _sample_row

    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = SamplingParams(temperature=1.0, min_p=0.4, top_p=0.75, seed=0)
    req = Request("r", [1], params, 0.0)
    seen = {_sample_row(row, req, ()) for _ in range(300)}
    assert seen == {0, 1}        # 0.2 survives min_p but not top_p over the renormalised mass


def test_bad_sampling_values_are_rejected_not_crashes():
    llm = tiny_llm()
    out = llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=3, stop_token_ids=[100000]),
                                          SamplingParams(max_tokens=3, temperature=1e-39)])
    assert out[0].finish_reason == "rejected" and "stop token id 100000" in out[0].error
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 3
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_cache_dtype_can_differ_from_the_model_dtype():
    llm = tiny_llm(cache={"dtype": "bfloat16"})
    assert llm.kv_cache.pool.dtype.is_floating_point and llm.kv_cache.pool.element_size() == 2
    out = llm.generate([list(range(3, 40)), [4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]


def test_automatic_request_ids_skip_ids_in_use():
    eng = tiny_llm().engine
    eng.add_request([5], SamplingParams(max_tokens=1), request_id="0")
    assert eng.add_request([6], SamplingParams(max_tokens=1)).request_id != "0"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_unknown_backend_option_names_the_key_and_the_allowed_ones(backend):
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match=r"backend\.options\.thread: .*allowed: .*threads"):
        tiny_llm(backend={"name": backend, "options": {"thread": 1}})


def test_text_a_tokenizer_cannot_take_and_seeds_past_64_bits_are_refused_by_name():
    from twophase.errors import InvalidSamplingParam

    llm = tiny_llm()
    (out,) = llm.generate(["a \ud800 b"], SamplingParams(max_tokens=2))
    assert out.finish_reason == "rejected" and "not valid Unicode" in out.error
    for seed in (2 ** 64, -(2 ** 63) - 1):
        with pytest.raises(InvalidSamplingParam, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, seed=2 ** 64 - 1))[0].token_ids


def test_the_memory_figures_say_what_the_pool_holds():
    llm = tiny_llm(cache={"num_blocks": 64, "block_size": 16}, model={"max_model_len": 256})
    m = llm.report()["memory"]
    a = llm.model.arch
    per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 4          # float32 K and V
    assert m["kv_tokens"] == 64 * 16 and m["max_concurrency"] == 64 // (256 // 16)
    assert m["kv_cache_bytes"] >= 64 * 16 * per_token
    assert m["weight_bytes"] == num_params(a) * 4 and m["headroom_bytes"] > 0


def test_a_cache_salt_keeps_prefixes_apart():
    """Requests share cached blocks only with requests of the same salt (none is a salt too)."""
    llm = tiny_llm(cache={"num_blocks": 64, "block_size": 4})
    prompt = list(range(9, 9 + 33))
    p = SamplingParams(max_tokens=2)
    runs = [llm.generate([prompt], SamplingParams(max_tokens=2, cache_salt=s))[0] for s in ("a", "b", "a", None)]
    assert [r.metrics["num_cached_tokens"] for r in runs] == [0, 0, 32, 0]
    assert llm.generate([prompt], p)[0].metrics["num_cached_tokens"] == 32
    assert len({tuple(r.token_ids) for r in runs}) == 1
