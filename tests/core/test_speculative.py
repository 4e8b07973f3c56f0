"""Speculative decoding keeps outputs exactly: the verifier's draws are distributed as the
target's distribution whatever was proposed, greedy outputs are token for token the same, and
rolling rejected drafts back leaks no block and never makes a draft a prefix-cache hit."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.int_backend import VOCAB, expected_tokens, make_engine, next_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twophase.core import verify as V
from twophase.core.ngram import NgramProposer
from twophase.core.proposer import Proposal
from twophase.core.request import Request
from twophase.core.sampling_params import SamplingParams
from twophase.core.spec_control import REFRESH, SpecController

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
CASES = {
    "draft q unlike p": torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3]),
    "draft q close to p": torch.tensor([0.45, 0.25, 0.1, 0.1, 0.1]),
    "draft q on one token": torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]),
}
DRAWS = 10 ** 6


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=p.numel()).double() / tokens.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


def _draw(q: torch.Tensor | None, draft: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    drafts = (torch.full((DRAWS,), draft) if q is None
              else torch.multinomial(q, DRAWS, replacement=True, generator=gen))
    return V.accept_or_resample(P, q, drafts, gen)


@pytest.mark.parametrize("case", CASES)
def test_accepted_or_resampled_tokens_are_distributed_as_the_target(case):
    assert _tv(_draw(CASES[case]), P) < 0.01


@pytest.mark.parametrize("draft", [0, 3])
def test_one_hot_proposals_keep_the_target_distribution(draft):
    """n-gram drafts have no q: the draft is kept with probability p(d), else a token is drawn
    from p without d."""
    assert _tv(_draw(None, draft), P) < 0.01


def test_a_planted_wrong_residual_is_caught(monkeypatch):
    monkeypatch.setattr(V, "residual", lambda p, q, drafts: p.unsqueeze(0))   # forgets to subtract q
    assert _tv(_draw(CASES["draft q unlike p"]), P) > 0.01


def _req(tokens: list[int], **params) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=50, **params), 0.0)


def test_greedy_verification_keeps_exactly_the_argmax_prefix():
    logits = torch.zeros(4, 6)
    for j, t in enumerate([2, 4, 1, 5]):
        logits[j, t] = 3.0
    assert V.verify(logits, _req([1]), Proposal([2, 4, 3]), ()) == [2, 4, 1]   # third rejected
    assert V.verify(logits, _req([1]), Proposal([2, 4, 1]), ()) == [2, 4, 1, 5]  # all + bonus
    assert V.verify(logits, _req([1]), Proposal([0, 4, 1]), ()) == [2]


def test_seeded_speculative_sampling_is_reproducible():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    runs = [V.verify(logits, _req([1], temperature=0.8, seed=7), Proposal([4, 9, 2]), ())
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_ngram_proposes_what_followed_the_longest_recurring_suffix():
    prop = NgramProposer(2, 4)
    assert prop.lookup([1, 2, 3, 4, 5, 9, 2, 3, 4], 3) == [5, 9, 2]
    assert prop.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert prop.lookup([7, 8, 9], 3) == []
    assert prop.lookup([1, 2, 1, 2], 0) == []
    # a short cycle: the most recent match has one token after it, an earlier one has k
    assert prop.lookup([4, 5, 4, 5, 4, 5, 4, 5], 3) == [4, 5, 4]


class Scripted:
    """Proposes the integer backend's true continuation, turned wrong at random places: the
    verifier must keep exactly the true prefix, whatever the mix."""

    def __init__(self, seed: int, p_wrong: float):
        self.rng, self.p_wrong = random.Random(seed), p_wrong

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        return [self._one(r, k) for r, k in zip(reqs, ks)]

    def release(self, req: Request) -> None:
        pass

    def _one(self, req: Request, k: int) -> Proposal:
        seq, out = list(req.token_ids), []
        for _ in range(self.rng.randint(0, k)):
            t = next_token(seq)
            if self.rng.random() < self.p_wrong:
                t = (t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB              # wrong
            out.append(t)
            seq.append(t)
        return Proposal(out)


@settings(deadline=None, max_examples=150, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), p_wrong=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       k=st.integers(1, 6), num_blocks=st.sampled_from([12, 24, 64]),
       prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
                        min_size=1, max_size=6))
def test_random_accepts_and_rejects_leave_outputs_and_the_pool_exact(seed, p_wrong, k, num_blocks,
                                                                     prompts):
    eng = make_engine(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=24, max_model_len=48)
    eng.scheduler.proposer, eng.scheduler.num_spec_tokens = Scripted(seed, p_wrong), k
    shared = [3, 1, 4, 1, 5, 9, 2, 6]                     # a common prefix: prefix-cache hits
    jobs = {f"r{i}": (shared + p if i % 2 else p, 1 + (seed + i) % 20) for i, p in enumerate(prompts)}
    held = {rid: eng.add_request(p, SamplingParams(max_tokens=n), rid) for rid, (p, n) in jobs.items()}
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 2000, "no progress"
        pool = eng.kv.pool
        held_blocks = sum(len(eng.kv.held_blocks(rid)) for rid in eng.kv.tables)
        assert pool.num_free + sum(1 for c in pool.ref_cnt if c) == pool.num_blocks
        assert held_blocks >= sum(1 for c in pool.ref_cnt if c)
        for req in eng.scheduler.running:           # rejected drafts' whole blocks went back
            assert len(eng.kv.block_table(req)) == eng.kv.blocks_for(req.num_computed_tokens), req
    for rid, (p, n) in jobs.items():
        assert held[rid].output_token_ids == expected_tokens(p, n), rid
    assert eng.kv.num_free_blocks == num_blocks and not any(eng.kv.pool.ref_cnt), "blocks leaked"
    # a newcomer whose prompt is a finished request's tokens must compute right through the
    # cache: were a block holding a rejected draft ever published, its K would change this
    for rid in list(jobs)[:2]:
        again = list(held[rid].token_ids)
        if len(again) + 3 > 48:
            continue
        newcomer = eng.add_request(again, SamplingParams(max_tokens=3), rid + "-again")
        while eng.has_unfinished():
            eng.step()
        assert newcomer.output_token_ids == expected_tokens(again, 3), "a stale block was a hit"
    drafted = sum(r.num_draft_tokens for r in held.values())
    kept = sum(r.num_accepted_tokens for r in held.values())
    # true drafts are all kept, but for those past the token a request stops at (k at most each)
    assert p_wrong > 0 or kept >= drafted - k * len(held), "a true draft was rejected"
    assert p_wrong < 1 or kept == 0, "a wrong draft was kept"


def _with_acceptance(rid: str, kept: int, tried: int) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
    r.num_draft_tokens, r.num_accepted_tokens = tried, kept
    return r


def _fed(a: float, b: float, verify_extra: float = 0.0) -> SpecController:
    """A controller that has seen decode steps costing ``a + b * tokens`` seconds, and
    ``verify_extra`` more for a step that verifies drafts."""
    c = SpecController(6)
    for n in (1, 2, 4, 8, 16, 32, 40):
        c.observe(n, 0, a + b * n)                                     # plain steps
        c.observe(1, n, a + b * (1 + n) + verify_extra)                # one decode and n drafts
    return c


def test_auto_drafts_freely_where_a_step_is_memory_bound_and_not_where_tokens_cost():
    c = _fed(a=0.010, b=0.0001)                       # reading weights dominates: drafts are cheap
    assert c.cost() == pytest.approx((0.010, 0.0001)) and c.plain_seconds(3) == pytest.approx(0.0103)
    assert c.plan([_with_acceptance("r", 50, 100)])["r"] >= 4
    assert c.plan([_with_acceptance("r", 0, 1000)])["r"] == 0     # drafts that are never kept
    busy = _fed(a=0.001, b=0.001)                     # each token costs as much as the weights
    reqs = [_with_acceptance(f"r{i}", 50, 100) for i in range(32)]
    assert set(busy.plan(reqs).values()) == {0}
    mixed = c.plan([_with_acceptance("good", 90, 100), _with_acceptance("poor", 5, 100)])
    assert mixed["good"] > mixed["poor"]


def test_a_new_request_starts_from_the_rate_everyones_drafts_were_kept_at():
    c = _fed(a=0.010, b=0.0015)                   # a draft costs 15% of a step
    newcomer = _with_acceptance("new", 0, 0)
    assert c.plan([newcomer])["new"] > 0          # no record anywhere: an even chance pays
    for _ in range(200):
        c.learn(drafted=32, kept=2)               # recent drafts were rarely kept
    assert c.shared_rate < 0.1
    assert c.plan([newcomer])["new"] == 0
    assert c.plan([_with_acceptance("known", 40, 50)])["known"] > 0   # its own record wins


def test_no_one_drafts_where_a_verify_pass_costs_more_than_its_drafts_add():
    """Drafts that each pay for themselves on the verify fit, but a verify pass that costs a
    third more than a plain step (a batch that leaves the fast decode path): a plain step wins."""
    reqs = [_with_acceptance(f"r{i}", 30, 100) for i in range(8)]
    assert sum(_fed(a=0.010, b=0.0005).plan(reqs).values()) > 0
    dear = _fed(a=0.010, b=0.0005, verify_extra=0.004)
    assert set(dear.plan(reqs).values()) == {0}
    for _ in range(REFRESH):
        dear.observe(8, 0, 0.014)
    assert sum(dear.plan(reqs).values()) > 0           # after a while, drafts are timed again


def test_auto_takes_a_plain_step_to_measure_its_baseline():
    c = SpecController(6)
    for n in (2, 3):
        c.observe(1, n, 0.01 + 0.001 * n)
    assert c.plan([_with_acceptance("r", 90, 100)]) == {"r": 0}        # no plain step seen yet
    c.observe(1, 0, 0.02)
    assert c.plan([_with_acceptance("r", 90, 100)])["r"] > 0
    for _ in range(REFRESH):
        c.observe(1, 4, 0.015)
    assert c.plan([_with_acceptance("r", 90, 100)]) == {"r": 0}        # time for another


def test_auto_explores_until_it_has_seen_steps_of_two_sizes():
    c = SpecController(6)
    assert c.plan([_with_acceptance("r", 0, 0)]) == {"r": 6}
    c.observe(1, 1, 0.01)
    c.observe(1, 1, 0.011)
    assert c.cost() is None


@pytest.mark.parametrize("p_wrong, rate", [(0.0, 1.0), (1.0, 0.0)])
def test_acceptance_is_reported_per_draft_position(p_wrong, rate):
    from twophase.core.metrics import speculative_summary

    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    eng.scheduler.proposer, eng.scheduler.num_spec_tokens = Scripted(1, p_wrong), 4
    for i in range(3):
        eng.add_request([3 + i, 9, 27], SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
    while eng.has_unfinished():
        eng.step()
    summary = speculative_summary(list(eng.steps.records))
    assert summary["acceptance_by_position"] and set(summary["acceptance_by_position"]) == {rate}
    assert summary["acceptance_rate"] == rate


def test_blocks_filled_by_kept_drafts_are_prefix_cache_hits_afterwards():
    """Kept drafts are hashed with the tokens they became, so a later prompt that repeats the
    whole sequence hits every full block."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    eng.scheduler.proposer, eng.scheduler.num_spec_tokens = Scripted(3, 0.0), 4
    first = eng.add_request([3, 9, 27, 4, 2], SamplingParams(max_tokens=30, ignore_eos=True), "a")
    while eng.has_unfinished():
        eng.step()
    assert first.num_accepted_tokens > 10
    again = eng.add_request(list(first.token_ids), SamplingParams(max_tokens=2), "b")
    while eng.has_unfinished():
        eng.step()
    assert again.num_cached_tokens == (len(first.token_ids) - 1) // 4 * 4


def test_seeded_sampling_draws_the_same_tokens_with_ngram_drafts():
    from helpers.models import tiny_llm

    prompts = [[5, 6, 7, 8, 9, 10] * 4, list(range(3, 30))]
    # a low temperature: random weights repeat themselves, so there is something to draft
    p = [SamplingParams(max_tokens=40, temperature=0.02, seed=11 + i, ignore_eos=True) for i in range(2)]
    plain = tiny_llm().generate(prompts, p)
    spec = tiny_llm(speculative={"method": "ngram", "num_tokens": 4})
    drafted = spec.generate(prompts, p)
    assert spec.report(drafted)["speculative"]["draft_tokens"] > 0
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
