"""Example tests of the scheduler's documented behaviour, one per rule, over the integer backend
(so every test also checks the pool was used correctly and outputs match a lone run)."""

from __future__ import annotations

import pytest
from helpers.int_backend import IntBackend, expected_tokens, greedy, make_engine

from twophase.core.engine import Engine
from twophase.core.request import Request
from twophase.errors import RequestRejected


def backend(eng: Engine) -> IntBackend:
    return eng.executor.prefill_backend  # type: ignore[return-value]


def step_ids(eng: Engine) -> set[str]:
    """One engine step; the ids of the requests that got a token in it."""
    return {d.request_id for d in eng.step()}


def run_to_end(eng: Engine, limit: int = 1000) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError(f"not finished after {limit} steps: {eng.scheduler.running}")


def start_decoding(eng: Engine, n: int, max_tokens: int = 200) -> list[Request]:
    """``n`` short requests, stepped until every one of them is in decode."""
    reqs = [eng.add_request([3 + i, 5, 7], greedy(max_tokens), f"d{i}") for i in range(n)]
    while not all(r.in_decode for r in reqs):
        eng.step()
    return reqs


def assert_outputs_alone(reqs: list[Request]) -> None:
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r.prompt_token_ids, r.params.max_tokens), r


def test_long_prompt_does_not_stall_running_decodes() -> None:
    """Decode-first: while a long prompt is prefilled in budget-sized chunks, every running
    decode still gets its token each step."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    decoders = start_decoding(eng, 2)
    long = eng.add_request(list(range(1, 61)), greedy(2), "long")
    steps = 0
    while long.num_output_tokens == 0:
        got = step_ids(eng)
        steps += 1
        assert {"d0", "d1"} <= got, f"step {steps}: decodes stalled by the prompt (got {got})"
    assert steps == -(-60 // (16 - 2)), "the prompt should take every token the decodes leave"
    assert all(c.num_tokens <= 16 for c in backend(eng).calls)
    run_to_end(eng)
    assert_outputs_alone([*decoders, long])


def test_prefill_first_schedules_prompts_before_decodes() -> None:
    """Prefill-first: a waiting prompt takes the budget before running decodes; decodes get
    only what is left (here nothing, while the prompt is longer than the budget)."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                      policy="prefill-first")
    decoders = start_decoding(eng, 2)
    eng.add_request(list(range(1, 21)), greedy(2), "long")
    n_calls = len(backend(eng).calls)
    assert step_ids(eng) == set(), "decodes ran although the prompt took the whole budget"
    call = backend(eng).calls[n_calls]
    assert call.query_lens == [8] and call.start_positions == [0]
    assert step_ids(eng) == set()
    got = step_ids(eng)            # 4 prompt tokens left: they go first, decodes share the rest
    assert got == {"long", "d0", "d1"}
    assert sorted(backend(eng).calls[-1].query_lens) == [1, 1, 4]
    run_to_end(eng)
    assert_outputs_alone(decoders)


def test_chunked_prefill_off_schedules_whole_prompts() -> None:
    """With chunked prefill off a prompt is only ever computed in one piece: it waits while
    decodes leave too little budget, and one longer than the budget is rejected up front."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                      chunked_prefill=False)
    decoders = start_decoding(eng, 2, max_tokens=6)
    long = eng.add_request(list(range(1, 31)), greedy(2), "long")      # 30 + 2 decodes = 32
    eng.step()
    assert long.num_computed_tokens == 30, "30 tokens + 2 decodes fit the budget"
    longer = eng.add_request(list(range(41, 72)), greedy(1), "longer")  # 31 + 3 decodes > 32
    eng.step()
    assert longer.num_computed_tokens == 0, "admitted although the whole prompt did not fit"
    while any(not d.finished for d in decoders):
        eng.step()
        assert longer.num_computed_tokens in (0, 31), "a prompt was split with chunking off"
    run_to_end(eng)
    for c in backend(eng).calls:
        assert all(n == 1 or s == 0 for n, s in zip(c.query_lens, c.start_positions)), c
    assert_outputs_alone([*decoders, long, longer])
    with pytest.raises(RequestRejected, match="max_num_batched_tokens"):
        eng.add_request(list(range(1, 32)), greedy(2))


def test_preemption_recomputes_and_gives_same_tokens() -> None:
    """When the pool runs out the newest request is preempted, recomputed later, and ends with
    exactly the tokens it would have produced alone."""
    prompts = [[20 + i] * 6 for i in range(3)]
    assert all(len(expected_tokens(p, 12)) == 12 for p in prompts), "no early EOS: 18 tokens each"
    for prefix_caching in (False, True):
        eng = make_engine(num_blocks=12, block_size=2, max_num_seqs=3, max_num_batched_tokens=32,
                          prefix_caching=prefix_caching)
        reqs = [eng.add_request(p, greedy(12), str(i)) for i, p in enumerate(prompts)]
        run_to_end(eng)
        assert reqs[-1].num_preemptions > 0 and reqs[0].num_preemptions == 0, "newest goes first"
        assert_outputs_alone(reqs)
        assert eng.kv.num_free_blocks == 12


def test_request_too_long_for_pool_is_rejected_and_others_go_on() -> None:
    """A request whose prompt + max_tokens could never fit the pool is refused at once, with
    the setting to change; one that needs exactly the whole pool is served, after the others."""
    eng = make_engine(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = eng.add_request([1, 2, 3, 4, 5], greedy(5), "a")
    with pytest.raises(RequestRejected, match="KV blocks") as e:
        eng.add_request(list(range(1, 17)), greedy(1), "big")     # 17 tokens: 5 blocks of 4
    assert "cache.num_blocks" in str(e.value)
    b = eng.add_request([6, 7, 8], greedy(13), "b")              # exactly the whole pool
    run_to_end(eng)
    assert "big" not in eng.requests
    assert a.finish_reason in ("stop", "length") and b.finish_reason in ("stop", "length")
    assert_outputs_alone([a, b])


def test_request_longer_than_context_is_rejected() -> None:
    """prompt + max_tokens beyond max_model_len is refused up front (not cut short later);
    exactly max_model_len is served."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=32)
    with pytest.raises(RequestRejected, match="max_model_len"):
        eng.add_request(list(range(1, 31)), greedy(3))           # 33 > 32
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request([], greedy(1))
    ok = eng.add_request(list(range(1, 31)), greedy(2))          # exactly 32
    run_to_end(eng)
    assert ok.num_tokens <= 32
    assert_outputs_alone([ok])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_cache_hit_skips_cached_tokens(block_size: int) -> None:
    """A second request sharing a finished request's prompt prefix reuses its full blocks:
    only the rest is computed, and its tokens are those it would produce alone."""
    shared = [(i * 7) % 96 + 1 for i in range(40)]
    results = {}
    for prefix_caching in (True, False):
        eng = make_engine(num_blocks=64, block_size=block_size, max_num_seqs=4,
                          max_num_batched_tokens=64, prefix_caching=prefix_caching)
        first = eng.add_request(shared + [1, 2], greedy(4), "first")
        run_to_end(eng)
        n_calls = len(backend(eng).calls)
        second = eng.add_request(shared + [3, 4, 5], greedy(4), "second")
        run_to_end(eng)
        assert_outputs_alone([first, second])
        results[prefix_caching] = second.num_cached_tokens, backend(eng).calls[n_calls]
    cached, call = results[True]
    assert cached == 40 // block_size * block_size
    assert call.start_positions == [cached] and call.query_lens == [43 - cached]
    assert results[False][0] == 0 and results[False][1].query_lens == [43]


def test_abort_frees_blocks_at_once() -> None:
    """Aborting a running request returns its blocks before the next step; aborting a queued
    one removes it from the queue; aborting twice or an unknown id is a no-op."""
    eng = make_engine(num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    running = eng.add_request(list(range(1, 10)), greedy(30), "running")
    waiting = eng.add_request([1, 2, 3], greedy(30), "waiting")   # max_num_seqs=1: stays queued
    for _ in range(3):
        eng.step()
    assert eng.kv.num_free_blocks < 16 and not waiting.num_computed_tokens
    assert eng.abort("running")
    assert eng.kv.num_free_blocks == 16 and not any(eng.kv.pool.ref_cnt)
    assert running.finish_reason == "abort" and "running" not in eng.kv.tables
    assert running not in eng.scheduler.running
    assert eng.abort("waiting") and waiting.finish_reason == "abort"
    assert not eng.has_unfinished() and eng.step() == []
    assert not eng.abort("running") and not eng.abort("nobody")


def test_waiting_request_is_not_starved() -> None:
    """Decodes never take the whole budget (it exceeds max_num_seqs), so a waiting prompt is
    admitted at once and prefilled with what is left, while the decodes keep running."""
    eng = make_engine(num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=5)
    decoders = start_decoding(eng, 3)
    late = eng.add_request(list(range(1, 21)), greedy(3), "late")
    bound = -(-20 // (5 - 3))          # 2 tokens a step are left after the 3 decodes
    for _ in range(bound):
        assert step_ids(eng) >= {"d0", "d1", "d2"}, "decodes lost their token"
    assert late.num_output_tokens == 1, f"no first token after {bound} steps: starved"
    assert all(not d.finished for d in decoders)
    run_to_end(eng)
    assert_outputs_alone([*decoders, late])
