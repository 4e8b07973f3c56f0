"""Property tests: random workloads through the real scheduler, KV manager and engine over the
integer backend. Whatever the arrivals, pool size, budget, block size, policy, chunking, prefix
caching, preemptions and aborts, the pool's bookkeeping stays exact and every request gets the
tokens it would get alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from helpers.int_backend import EOS, VOCAB, expected_tokens, greedy, make_engine
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from twophase.core.engine import Engine
from twophase.core.request import Request
from twophase.errors import RequestRejected


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    arrival: int                  # the engine step before which it is added
    abort_at: int | None          # the step before which it is aborted (if still live)


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    policy: str
    chunked_prefill: bool
    prefix_caching: bool
    max_model_len: int
    jobs: list[Job]


tokens = st.integers(1, VOCAB - 1)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Pools between the smallest request and the sum of all (preemption), small budgets
    (chunking), and prompts drawn from a few shared prefixes (prefix-cache hits, including on
    blocks of finished or preempted requests)."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    max_seqs = draw(st.integers(1, 6))
    prefixes = draw(st.lists(st.lists(tokens, max_size=40), min_size=1, max_size=3))
    jobs = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, min_size=1, max_size=20))
        abort = draw(st.integers(0, 160))
        jobs.append(Job(prompt, draw(st.integers(1, 24)), draw(st.integers(0, 12)),
                        abort if abort < 40 else None))
    sizes = [len(j.prompt) + j.max_tokens for j in jobs]
    pool_tokens = draw(st.integers(min(sizes), sum(sizes)))
    return Workload(bs, -(-pool_tokens // bs), max_seqs, draw(st.integers(max_seqs + 1, 80)),
                    draw(st.sampled_from(["decode-first", "prefill-first"])),
                    draw(st.booleans()), draw(st.booleans()), draw(st.integers(min(sizes), 128)),
                    jobs)


def check_pool(eng: Engine) -> None:
    """Reference counts equal table membership; the free queue holds exactly the unreferenced
    blocks; only running requests hold blocks, each enough for its computed tokens."""
    kv, pool = eng.kv, eng.kv.pool
    held: Counter[int] = Counter()
    for rid in kv.tables:
        table = kv.held_blocks(rid)
        assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
        held.update(table)
    assert pool.ref_cnt == [held[b] for b in range(pool.num_blocks)], (
        f"ref counts {pool.ref_cnt} != table membership {dict(held)}")
    assert set(pool.free) == {b for b in range(pool.num_blocks) if pool.ref_cnt[b] == 0}
    running = {r.request_id: r for r in eng.scheduler.running}
    assert set(kv.tables) == set(running), (
        f"blocks held by {sorted(kv.tables)}, running {sorted(running)}")
    for r in running.values():
        assert len(kv.block_table(r)) * kv.block_size >= r.num_computed_tokens, r
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h, f"cache maps a hash to block {b} which has another"


def unservable(w: Workload, job: Job) -> bool:
    """The only reasons a request may be turned away at add_request."""
    total = len(job.prompt) + job.max_tokens
    return (total > w.max_model_len or -(-total // w.block_size) > w.num_blocks
            or (not w.chunked_prefill and total > w.budget))


def run_workload(w: Workload) -> None:
    """Add, abort and step as the workload says, checking the pool after every change; then
    check the end state, every output against a lone run, and every backend call's size."""
    eng = make_engine(w.num_blocks, w.block_size, w.max_num_seqs, w.budget, w.policy,
                      w.chunked_prefill, w.prefix_caching, w.max_model_len)
    accepted: dict[str, Job] = {}
    held: dict[str, Request] = {}                   # the engine forgets a request once it ends
    aborted: set[str] = set()
    last_arrival = max(j.arrival for j in w.jobs)
    limit = 100 + 4 * sum(len(j.prompt) + j.max_tokens for j in w.jobs)
    step = 0
    while step <= last_arrival or eng.has_unfinished():
        for i, job in enumerate(w.jobs):
            rid = str(i)
            if job.arrival == step:
                try:
                    held[rid] = eng.add_request(job.prompt, greedy(job.max_tokens), request_id=rid)
                    accepted[rid] = job
                except RequestRejected as e:
                    assert str(e), "a rejection must say why"
                    assert unservable(w, job), f"job {i} rejected but servable: {e}"
            if job.abort_at == step and rid in accepted and eng.abort(rid):
                aborted.add(rid)
                assert rid not in eng.kv.tables, "abort must free the request's blocks at once"
                check_pool(eng)
        eng.step()
        check_pool(eng)
        step += 1
        assert step < limit, f"no progress after {step} steps: {eng.scheduler.running}"

    pool = eng.kv.pool
    assert pool.num_free == w.num_blocks and not any(pool.ref_cnt), "blocks leaked"
    assert not eng.kv.tables
    for rid, job in accepted.items():
        req = held[rid]
        want = expected_tokens(job.prompt, job.max_tokens)
        assert req.finished, req
        if rid in aborted:
            assert req.finish_reason == "abort"
            assert req.output_token_ids == want[:req.num_output_tokens], f"request {rid}"
        else:
            assert req.output_token_ids == want, f"request {rid} ({req.num_preemptions} preempted)"
            assert req.finish_reason == ("stop" if want[-1] == EOS else "length")
    reqs = [held[rid] for rid in accepted]
    assert not eng.requests, "the engine must forget finished requests"
    event(f"preempted: {eng.scheduler.num_preemptions > 0}")
    event(f"prefix-cache hit: {any(r.num_cached_tokens for r in reqs)}")
    event(f"prompt longer than budget: {any(r.num_prompt_tokens > w.budget for r in reqs)}")
    event(f"rejected: {len(accepted) < len(w.jobs)}, aborted: {bool(aborted)}")
    for call in eng.executor.prefill_backend.calls:
        assert call.num_tokens <= w.budget, f"{call} exceeds max_num_batched_tokens {w.budget}"
        assert call.num_seqs <= w.max_num_seqs, f"{call} exceeds max_num_seqs {w.max_num_seqs}"


@settings(deadline=None, max_examples=600, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example(Workload(  # found by this test: the double scheduling of the next test's example
    block_size=1, num_blocks=30, max_num_seqs=2, budget=17, policy="prefill-first",
    chunked_prefill=False, prefix_caching=True, max_model_len=17,
    jobs=[Job([1] * 12, 5, 1, None), Job([2] + [1] * 11, 4, 1, None)]))
def test_random_workloads_keep_pool_exact_and_outputs_unchanged(w: Workload) -> None:
    run_workload(w)


@st.composite
def tight_workloads(draw: st.DrawFn) -> Workload:
    """Many requests sharing one prefix in a pool that holds about two of them: preemption and
    re-admission through the prefix cache on nearly every step."""
    bs = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.lists(tokens, min_size=1, max_size=24))
    jobs = [Job(prefix + draw(st.lists(tokens, max_size=4)),
                draw(st.integers(1, 12)), draw(st.integers(0, 6)), None)
            for _ in range(draw(st.integers(2, 6)))]
    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    max_seqs = draw(st.integers(2, 6))
    return Workload(bs, -(-longest // bs) + draw(st.integers(0, 3)), max_seqs,
                    draw(st.integers(max_seqs + 1, 40)),
                    draw(st.sampled_from(["decode-first", "prefill-first"])),
                    draw(st.booleans()), True, 128, jobs)


@settings(deadline=None, max_examples=400, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(tight_workloads())
@example(Workload(  # prefill-first: a preempted request re-admitted with all but its last token
    # cached is already in decode, and gets scheduled twice in one step (prefill and decode)
    block_size=1, num_blocks=3, max_num_seqs=2, budget=3, policy="prefill-first",
    chunked_prefill=True, prefix_caching=True, max_model_len=128,
    jobs=[Job([1], 2, 0, None), Job([1], 2, 0, None), Job([1], 1, 0, None)]))
def test_preemption_with_prefix_cache_keeps_outputs_unchanged(w: Workload) -> None:
    run_workload(w)
