"""Disaggregated prefill and decode through the KV connector, two engines in one process: the
prefill engine keeps a prompt's blocks under a lease, the decode engine pulls them and goes on.
Tokens must equal one engine's, and no block may stay taken on either side."""

from __future__ import annotations

import pytest
import torch
from helpers.models import random_prompts, tiny_llm
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase import SamplingParams
from twophase.core.kv_transfer import (
    KVTransferParams,
    LocalTransport,
    continues_on_peer,
    first_token_params,
    joined,
    layout_of,
    wants_decode_peer,
)
from twophase.errors import RequestRejected
from twophase.kv_formats import KV_FORMATS, kv_format

SMALL = {"cache": {"num_blocks": 64, "block_size": 4},
         "scheduler": {"max_num_batched_tokens": 48, "max_num_seqs": 8}}


class Pair:
    """A prefill engine and a decode engine joined by a ``LocalTransport``."""

    def __init__(self, dtype: str = "auto", **cluster):
        # room for every prompt's lease: the tests prefill them all before decoding any
        self.p = tiny_llm(**{**SMALL, "cache": {"num_blocks": 512, "block_size": 4, "dtype": dtype}})
        self.d = tiny_llm(**{**SMALL, "cache": {**SMALL["cache"], "dtype": dtype}}, cluster=cluster)
        self.transport = LocalTransport({self.p.engine.connector.engine_id: self.p.engine.connector})
        self.d.engine.connector.transport = self.transport

    def prefill(self, prompt: list[int], params: SamplingParams):
        peer = KVTransferParams(do_remote_decode=True) if wants_decode_peer(params) else None
        [out] = run(self.p.engine, [(prompt, first_token_params(params), peer, ())])
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """As the cluster's frontend runs a request, by the same rules (``kv_transfer.py``)."""
        firsts = [self.prefill(p, params) for p in prompts]
        handed = [i for i, f in enumerate(firsts) if continues_on_peer(f)]
        jobs = [(prompts[i], params, KVTransferParams.from_dict(firsts[i].kv_transfer_params),
                 firsts[i].token_ids) for i in handed]
        outs = dict(zip(handed, run(self.d.engine, jobs)))
        whole = [joined(f, outs[i], params) if i in outs else f for i, f in enumerate(firsts)]
        self.texts = [o.text for o in whole]
        self.reasons = [o.finish_reason for o in whole]
        return [o.token_ids for o in whole]

    def used(self) -> tuple[int, int]:
        return self.p.engine.kv.num_used_blocks, self.d.engine.kv.num_used_blocks


def run(engine, jobs):
    """Add every job, step until all finish; the outputs in order."""
    ids = [engine.add_request(p, params, kv_transfer=t, first_token_ids=first).request_id
           for p, params, t, first in jobs]
    done = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                done[d.request_id] = d.output
    return [done[i] for i in ids]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_disaggregated_tokens_equal_one_engines_and_every_block_returns(dtype):
    pair = Pair(dtype)
    prompts = random_prompts(10, seed=1) + [[5] * 8, [7] * 4, [9] * 3, [11]]   # whole blocks, short
    alone = tiny_llm(**{**SMALL, "cache": {**SMALL["cache"], "dtype": dtype}}).generate(prompts, GREEDY)
    assert pair.generate(prompts, GREEDY) == [o.token_ids for o in alone]
    # byte tokens: a character split between the first token and the next is sent once, whole
    assert pair.texts == [o.text for o in alone]
    assert pair.used() == (0, 0)
    assert pair.p.engine.connector.num_leased_blocks == 0


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_a_stop_string_spanning_the_first_token_and_the_next_is_found(min_tokens):
    """The prefill side's first token and the decode side's second: a stop string made of the
    end of one and the start of the other ends the request where one engine ends it."""
    from twophase.core.detokenizer import IncrementalDetokenizer

    prompts = random_prompts(24, seed=3)
    one = tiny_llm(**SMALL)
    stops = []
    for o in one.generate(prompts, GREEDY):     # the first two tokens' texts, each alone
        detok = IncrementalDetokenizer(one.tokenizer)
        t1, t2 = detok.push(o.token_ids[0]), detok.push(o.token_ids[1])
        if t1 and t2:
            stops.append(t1[-1] + t2[:2])
    assert len(stops) >= 3, "the prompts must give tokens with text"
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=stops, min_tokens=min_tokens)
    alone = tiny_llm(**SMALL).generate(prompts, params)
    pair = Pair()
    assert pair.generate(prompts, params) == [o.token_ids for o in alone]
    assert pair.texts == [o.text for o in alone]
    assert pair.reasons == [o.finish_reason for o in alone]
    assert sum(r == "stop" for r in pair.reasons) >= 3
    assert pair.used() == (0, 0)


def test_one_token_is_the_prefill_sides_alone_and_flushed_whole():
    """Nothing for a peer: no lease, and an incomplete character at the end is flushed (U+FFFD)
    as one engine flushes it, not held back for a decode side that never comes."""
    pair = Pair()
    prompts = random_prompts(40, seed=4)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    alone = tiny_llm(**SMALL).generate(prompts, one)
    assert any("\ufffd" in o.text for o in alone), "some first token must be a partial character"
    assert pair.generate(prompts, one) == [o.token_ids for o in alone]
    assert pair.texts == [o.text for o in alone]
    assert pair.p.engine.connector.num_leased_blocks == 0


def test_seeded_sampling_continues_the_prefill_sides_generator():
    pair = Pair()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    prompts = random_prompts(4, seed=2)
    alone = [o.token_ids for o in tiny_llm(**SMALL).generate(prompts, params)]
    assert pair.generate(prompts, params) == alone


def test_the_transfer_parameters_say_what_moves():
    pair = Pair()
    out = pair.prefill(list(range(3, 21)), GREEDY)            # 18 tokens: 4 full blocks of 4
    t = out.kv_transfer_params
    assert t["do_remote_prefill"] and t["num_tokens"] == 16 and len(t["remote_block_ids"]) == 4
    assert t["remote_engine_id"] == pair.p.engine.connector.engine_id
    assert t["layout"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 4,
                           "dtype": "float32", "state_bytes": 0, "planes": 2}
    assert pair.used()[0] == 4, "the lease holds the prompt's full blocks"


def test_an_unclaimed_lease_expires():
    pair = Pair()
    now = [0.0]
    pair.p.engine.connector.clock = lambda: now[0]
    pair.prefill(list(range(3, 30)), GREEDY)
    assert pair.used()[0] > 0
    now[0] = 29.0
    pair.p.engine.expire_leases()
    assert pair.used()[0] > 0
    now[0] = 31.0
    pair.p.engine.expire_leases()
    assert pair.used() == (0, 0)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_errors_or_recomputes(policy):
    pair = Pair(kv_load_failure=policy)
    prompt = list(range(3, 40))
    first = pair.prefill(prompt, GREEDY)
    pair.transport.fail = "the peer died"
    [out] = run(pair.d.engine, [(prompt, GREEDY, KVTransferParams.from_dict(first.kv_transfer_params),
                                 first.token_ids)])
    if policy == "fail":
        assert out.finish_reason == "error"
    else:
        alone = tiny_llm(**SMALL).generate([prompt], GREEDY)[0].token_ids
        assert first.token_ids + out.token_ids == alone
    assert pair.used()[1] == 0


def test_a_pull_that_never_arrives_fails_after_the_timeout_and_the_abort_reaches_the_peer():
    pair = Pair(kv_load_timeout_s=2.0)
    now = [0.0]
    pair.d.engine.connector.clock = lambda: now[0]
    prompt = list(range(3, 40))
    first = pair.prefill(prompt, GREEDY)
    pair.transport.hold = True
    req = pair.d.engine.add_request(prompt, GREEDY, kv_transfer=KVTransferParams.from_dict(
        first.kv_transfer_params), first_token_ids=first.token_ids)
    assert pair.d.engine.step() == [] and req.status.value == "loading"
    now[0] = 1.9
    assert pair.d.engine.step() == []
    now[0] = 2.1
    [delta] = pair.d.engine.step()
    assert delta.finish_reason == "error" and "2 s" in delta.error
    assert pair.used() == (0, 0), "the peer was told (its lease released) and this pool freed"


def test_an_abort_while_pulling_frees_both_sides():
    pair = Pair()
    prompt = list(range(3, 40))
    first = pair.prefill(prompt, GREEDY)
    pair.transport.hold = True
    req = pair.d.engine.add_request(prompt, GREEDY, kv_transfer=KVTransferParams.from_dict(
        first.kv_transfer_params), first_token_ids=first.token_ids)
    pair.d.engine.step()
    assert pair.used()[1] > 0
    pair.d.engine.abort(req.request_id)
    assert pair.used() == (0, 0)


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
def test_blocks_cross_between_workers_as_bytes_in_every_format(fmt):
    """What the Ray workers send (``cluster/host.py``: the blocks viewed as bytes, since numpy
    has no bfloat16 or float8) comes back as the same pool rows, in the pool's shape: int8 rows
    are longer than the head dimension."""
    f = kv_format(fmt)
    values = torch.randn(2, 2, 3, 2, 4, 64, generator=torch.Generator().manual_seed(0))
    pool = f.encode(values)                                  # [layers, 2, blocks, heads, bs, row]
    wire = torch.from_numpy(pool[:, :, [2, 0]].contiguous().view(torch.uint8).numpy())
    back = layout_of(pool).blocks_from_bytes(wire, 2)
    assert back.dtype == pool.dtype and back.shape == pool[:, :, [2, 0]].shape
    assert torch.equal(back.view(torch.uint8), pool[:, :, [2, 0]].view(torch.uint8))


def test_a_peer_with_another_layout_is_refused_when_the_request_arrives():
    pair = Pair()
    other = tiny_llm(cache={"num_blocks": 64, "block_size": 8})
    other.engine.connector.transport = pair.transport
    first = pair.prefill(list(range(3, 40)), GREEDY)
    with pytest.raises(RequestRejected, match="layout"):
        other.engine.add_request(list(range(3, 40)), GREEDY, first_token_ids=first.token_ids,
                                 kv_transfer=KVTransferParams.from_dict(first.kv_transfer_params))


def test_malformed_transfer_parameters_are_the_requests_fault():
    with pytest.raises(RequestRejected, match="unknown keys"):
        KVTransferParams.from_dict({"do_remote_prefill": True, "bogus": 1})
    with pytest.raises(RequestRejected, match="negative"):
        KVTransferParams.from_dict({"remote_block_ids": [-1]})


@settings(deadline=None, max_examples=25)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 5))
def test_no_block_leaks_on_either_side_whatever_the_mix(lengths, aborted):
    pair = PAIR()
    prompts = [list(range(3, 3 + n)) for n in lengths]
    firsts = [pair.prefill(p, GREEDY) for p in prompts]
    reqs = [pair.d.engine.add_request(p, GREEDY, first_token_ids=f.token_ids,
                                      kv_transfer=KVTransferParams.from_dict(f.kv_transfer_params))
            for p, f in zip(prompts, firsts)]
    pair.d.engine.step()
    if aborted < len(reqs):
        pair.d.engine.abort(reqs[aborted].request_id)
    while pair.d.engine.has_unfinished():
        pair.d.engine.step()
    assert pair.used() == (0, 0)


_pair = []


def PAIR() -> Pair:
    """One pair for every hypothesis example (loading a model per example is slow)."""
    if not _pair:
        _pair.append(Pair())
    return _pair[0]
