"""``n`` choices of one prompt: the prompt computed once, its whole blocks shared by every choice
(a reference each, nothing copied), each choice sampling with ``seed + i``, so each equals the
prompt sent alone with that seed; preemption, aborts and a pool too small lose nothing."""

from __future__ import annotations

import pytest
from helpers.models import PREEMPTING, random_prompts, tiny_llm

from twophase import SamplingParams
from twophase.errors import RequestRejected

BS = 4


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(cache={"num_blocks": 96, "block_size": BS})


def _alone(llm, prompt, params: SamplingParams) -> list[list[int]]:
    seeds = [None] * params.n if params.seed is None else [params.seed + i for i in range(params.n)]
    return [llm.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1, "seed": s}))[0].token_ids
            for s in seeds]


@pytest.mark.parametrize("length", [3, 4, 29, 32])      # within a block, whole blocks, a tail
def test_choices_equal_the_prompt_sent_alone_with_their_seeds(llm, length):
    prompt = list(range(5, 5 + length))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=5)
    outs = llm.generate([prompt], params)
    assert [o.index for o in outs] == list(range(5))
    assert [o.token_ids for o in outs] == _alone(llm, prompt, params)
    assert len({tuple(o.token_ids) for o in outs}) > 1          # the choices differ
    shared = (length - 1) // BS * BS
    assert [o.metrics["num_cached_tokens"] for o in outs[1:]] == [shared] * 4


def test_the_prompt_is_held_once(llm):
    """At the fork, the choices hold the prompt's whole blocks with the parent: the pool counts
    them once, each choice's tail on its own."""
    eng = llm.engine
    prompt = list(range(7, 7 + 29))                      # 7 whole blocks and a tail of 1
    parent = eng.add_request(prompt, SamplingParams(max_tokens=4, n=8))
    children = list(parent.forks)
    used = eng.kv.num_used_blocks
    eng.step()                                           # the prompt up to its last whole block
    assert parent.num_computed_tokens == 28 and not parent.forks
    tables = [eng.kv.block_table(r) for r in [parent, *children]]
    assert all(t[:7] == tables[0][:7] for t in tables)
    assert eng.kv.num_used_blocks - used == 7            # its 7 whole blocks, held by all 8
    eng.step()                                           # every choice computes its own tail
    assert eng.kv.num_used_blocks - used == 7 + 8        # one tail block a choice
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.num_used_blocks == 0 or all(eng.kv.pool.ref_cnt[b] == 0 for b in range(eng.kv.pool.num_blocks))


def test_choices_under_preemption_lose_nothing():
    llm = tiny_llm(**{**PREEMPTING, "scheduler": {**PREEMPTING["scheduler"], "admission": "greedy"}})
    prompts = random_prompts(8, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=3)
    outs = llm.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    want = [t for p in prompts for t in _alone(llm, p, params)]
    assert [o.token_ids for o in outs] == want


def test_an_aborted_parent_leaves_its_choices_running(llm):
    eng = llm.engine
    prompt = list(range(9, 9 + 21))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3)
    parent = eng.add_request(prompt, params)
    ids = [c.request_id for c in parent.forks]
    eng.abort(parent.request_id)                          # before its prompt was computed
    eng.abort(ids[1])                                     # and one choice
    done = {}
    while eng.has_unfinished():
        done |= {d.request_id: d.output for d in eng.step() if d.output is not None}
    assert set(done) == {ids[0]}
    assert done[ids[0]].token_ids == _alone(llm, prompt, params)[1]


def test_choices_past_the_limits_are_refused(llm):
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, n=65))
    with pytest.raises(RequestRejected, match="20 choices"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=60, n=20))
    with pytest.raises(Exception, match="n must be at least 1"):
        SamplingParams(n=0)
    assert not llm.engine.has_unfinished()


def test_choices_with_ngram_drafts_equal_without():
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=2, n=3)
    plain = [o.token_ids for o in tiny_llm(cache={"num_blocks": 96, "block_size": BS}).generate([prompt], params)]
    spec = tiny_llm(cache={"num_blocks": 96, "block_size": BS},
                    speculative={"method": "ngram", "num_tokens": 3})
    assert [o.token_ids for o in spec.generate([prompt], params)] == plain
