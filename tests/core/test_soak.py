"""Four hundred requests through a pool far too small for them, with random lengths and random
aborts: each one finishes or is refused, no block leaks, memory stays flat, and admission that
keeps the running sequences' growth free preempts less than admission that takes every free
block (same seed, both measured)."""

from __future__ import annotations

import random

import pytest
from helpers.models import tiny_llm

from twophase import SamplingParams
from twophase.device import resident_bytes
from twophase.errors import RequestRejected

REQUESTS = 400                  # enough to preempt hundreds of times (greedy: ~200)
ARRIVALS_PER_STEP = 3


def rss_mib() -> float:
    return resident_bytes() / 2**20


def soak(admission: str, seed: int = 0) -> dict:
    llm = tiny_llm(backend={"options": {"threads": 1}}, cache={"num_blocks": 48, "block_size": 4},
                   scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 64, "admission": admission})
    eng, rng = llm.engine, random.Random(seed)
    pending = list(range(REQUESTS))
    ended: dict[str, str] = {}
    refused, live = 0, set()
    rss_warm = None
    while pending or eng.has_unfinished():
        for _ in range(min(ARRIVALS_PER_STEP, len(pending))):
            i = pending.pop(0)
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 80))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=rng.random() < 0.5,
                                    temperature=rng.choice([0.0, 0.8]), seed=i)
            try:
                live.add(eng.add_request(prompt, params, request_id=f"r{i}").request_id)
            except RequestRejected:
                refused += 1
        for d in eng.step():
            if d.finished:
                ended[d.request_id] = d.finish_reason
                live.discard(d.request_id)
        if live and rng.random() < 0.05:                      # a client goes away
            victim = rng.choice(sorted(live))
            out = eng.abort(victim)
            assert out is not None and out.finish_reason == "abort"
            ended[victim] = "abort"
            live.discard(victim)
        if rss_warm is None and len(ended) >= 100:
            rss_warm = rss_mib()
    rep = llm.report()
    assert rep["preemptions"] == eng.scheduler.num_preemptions
    assert rep["recomputed_tokens"] > 0 or not rep["preemptions"]
    return {"ended": ended, "refused": refused, "free": eng.kv.num_free_blocks, "blocks": llm.num_blocks,
            "preemptions": eng.scheduler.num_preemptions, "recomputed": rep["recomputed_tokens"],
            "rss_warm": rss_warm, "rss_end": rss_mib(),
            "pool": eng.kv.pool}


@pytest.fixture(scope="module")
def runs():
    return {a: soak(a) for a in ("reserve", "greedy")}


@pytest.mark.parametrize("admission", ["reserve", "greedy"])
def test_every_request_ends_or_is_refused_and_no_block_leaks(runs, admission):
    r = runs[admission]
    assert len(r["ended"]) + r["refused"] == REQUESTS
    assert set(r["ended"].values()) <= {"stop", "length", "abort"}
    assert r["free"] == r["blocks"] and not any(r["pool"].ref_cnt)
    assert r["preemptions"] > 0, "the pool should be too small for the load"


def test_memory_stays_flat(runs):
    r = runs["reserve"]
    assert r["rss_end"] <= r["rss_warm"] * 1.05, (r["rss_warm"], r["rss_end"])


def test_reserving_growth_preempts_less_than_taking_every_free_block(runs):
    assert runs["reserve"]["preemptions"] < runs["greedy"]["preemptions"]
    assert runs["reserve"]["recomputed"] < runs["greedy"]["recomputed"]
