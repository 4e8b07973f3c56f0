"""Speculation with a draft model (``method = "draft"``) keeps outputs exactly: greedy tokens
are the target's own through preemption, chunked prefill, a draft pool too small for every
sequence and a draft model that fails; seeded sampling is reproducible and distributed as the
target's; neither pool leaks a block; a draft that cannot work is refused before any weights
load."""

from __future__ import annotations

import math
import sys
from collections import Counter

import pytest
import torch
from helpers.models import PREEMPTING, random_prompts, tiny_llm

from twophase import SamplingParams
from twophase.core import draft_proposer, sampler
from twophase.core.request import Request
from twophase.errors import ConfigError
from twophase.models import loader
from twophase.paths import cache_dir

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAME_AS_TARGET = {"seed": 0}          # the target's own weights: every draft is kept
SHALLOW = {"num_layers": 1}           # the target's first layer only: few drafts are kept


def _draft_llm(draft: dict):
    return tiny_llm(**PREEMPTING, speculative={"method": "draft", "num_tokens": 4, "draft": draft})


def _assert_nothing_held(llm) -> None:
    proposer = llm.engine.scheduler.proposer
    assert llm.engine.kv.num_free_blocks == llm.num_blocks, "target blocks leaked"
    assert proposer.kv.num_free_blocks == llm.draft.num_blocks, "draft blocks leaked"
    assert not proposer.kv.tables and not proposer.shadows


@pytest.mark.parametrize("draft, rate", [(SAME_AS_TARGET, 1.0), (SHALLOW, None)],
                         ids=["same-as-target", "shallow"])
def test_greedy_tokens_are_the_targets_through_preemption(draft, rate, preempting_torch_tokens):
    llm = _draft_llm(draft)
    outs = llm.generate(random_prompts(), GREEDY)
    rep = llm.report(outs)
    assert rep["preemptions"] > 0 and rep["steps_by_mix"].get("mixed")
    assert [o.token_ids for o in outs] == preempting_torch_tokens
    spec = rep["speculative"]
    assert spec["draft_tokens"] > 50
    if rate is not None:
        assert spec["acceptance_rate"] == rate
    else:
        assert spec["acceptance_rate"] < 0.5
    _assert_nothing_held(llm)


@pytest.mark.parametrize("num_blocks", ["auto", 6])
def test_drafts_are_the_draft_models_own_greedy_continuation(num_blocks):
    """The K/V a shadow keeps (rejected drafts cut away, a preempted or evicted sequence built
    again) give the drafts the draft model makes from scratch for the target's tokens."""
    llm = _draft_llm({**SHALLOW, "num_blocks": num_blocks})
    proposer = llm.engine.scheduler.proposer
    drafted, propose = [], proposer.propose

    def propose_spy(reqs, ks):
        seen = [list(r.token_ids) for r in reqs]
        proposals = propose(reqs, ks)
        drafted.extend((t, p.token_ids) for t, p in zip(seen, proposals) if p.token_ids)
        return proposals

    proposer.propose = propose_spy
    rep = llm.report(llm.generate(random_prompts(), GREEDY))
    assert rep["preemptions"] > 0 and len(drafted) >= 8
    alone = tiny_llm(model=SHALLOW, cache={"num_blocks": 512})
    want = alone.generate([t for t, _ in drafted],
                          [SamplingParams(max_tokens=len(d), ignore_eos=True) for _, d in drafted])
    assert [d for _, d in drafted] == [o.token_ids for o in want]
    _assert_nothing_held(llm)


def test_a_draft_pool_too_small_evicts_and_falls_back(preempting_torch_tokens):
    llm = _draft_llm({**SAME_AS_TARGET, "num_blocks": 6})        # 24 tokens, prompts up to 70
    proposer = llm.engine.scheduler.proposer
    short, evicted = [], Counter()
    allocate, drop = proposer.kv.allocate, proposer._drop_kv

    def allocate_spy(req, n, computed=()):
        ok = allocate(req, n, computed)
        short.extend([] if ok else [req.request_id])
        return ok

    def drop_spy(shadow):
        evicted[shadow.request_id] += 1
        return drop(shadow)

    proposer.kv.allocate, proposer._drop_kv = allocate_spy, drop_spy
    outs = llm.generate(random_prompts(), GREEDY)
    spec = llm.report(outs)["speculative"]
    assert short, "the draft pool never ran short"
    assert evicted, "no shadow was evicted"
    assert [o.token_ids for o in outs] == preempting_torch_tokens
    assert spec["draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0
    _assert_nothing_held(llm)


def test_a_failing_draft_model_costs_drafts_not_requests(preempting_torch_tokens):
    llm = _draft_llm(SAME_AS_TARGET)
    backend = llm.draft.decode_backend
    calls = [0]

    def flaky(method):
        def call(batch):
            calls[0] += 1
            if calls[0] % 4 == 0:
                raise RuntimeError("draft backend fault")
            return method(batch)
        return call

    backend.prefill, backend.decode = flaky(backend.prefill), flaky(backend.decode)
    outs = llm.generate(random_prompts(), GREEDY)
    spec = llm.report(outs)["speculative"]
    assert llm.engine.scheduler.proposer.failures > 2
    assert [o.token_ids for o in outs] == preempting_torch_tokens
    assert all(o.finish_reason == "length" for o in outs)
    # shadows a failure may have half written are recomputed: every draft is still the target's
    assert spec["accepted_tokens"] > 0 and spec["acceptance_rate"] == 1.0
    _assert_nothing_held(llm)


def test_seeded_sampling_is_reproducible_with_a_draft():
    prompts = random_prompts()
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = _draft_llm(SHALLOW)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = [o.token_ids for o in llm.generate(prompts, params)]
    fresh = [o.token_ids for o in _draft_llm(SHALLOW).generate(prompts, params)]
    assert llm.report()["speculative"]["draft_tokens"] > 0
    assert first == again == fresh
    _assert_nothing_held(llm)


def test_the_draft_proposer_never_writes_a_request(monkeypatch):
    """The scheduler is the only writer of request state: while the proposer drafts (syncing,
    evicting and rebuilding its shadows, drawing seeded drafts), no ``Request`` is built or
    assigned to."""
    written, by_proposer = Counter(), []
    setattr_ = object.__setattr__

    def spy(req, name, value):
        written[name] += 1
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == draft_proposer.__name__:
                by_proposer.append(f"{name} by {frame.f_code.co_name}")
                break
            frame = frame.f_back
        setattr_(req, name, value)

    monkeypatch.setattr(Request, "__setattr__", spy)
    prompts = random_prompts()
    params = [GREEDY if i % 2 else SamplingParams(max_tokens=16, temperature=0.8, seed=i,
                                                  ignore_eos=True) for i in range(len(prompts))]
    llm = _draft_llm({**SHALLOW, "num_blocks": 6})
    proposer = llm.engine.scheduler.proposer
    propose, changed = proposer.propose, []

    def propose_spy(reqs, ks):              # nor changed in place (a list it shares)
        before = [(list(r.token_ids), r.num_computed_tokens) for r in reqs]
        proposals = propose(reqs, ks)
        changed.extend(r.request_id for r, b in zip(reqs, before)
                       if b != (r.token_ids, r.num_computed_tokens))
        return proposals

    proposer.propose = propose_spy
    rep = llm.report(llm.generate(prompts, params))
    assert rep["preemptions"] > 0 and rep["speculative"]["draft_tokens"] > 0
    assert written["num_computed_tokens"] > 0                    # the scheduler's own writes
    assert not by_proposer, f"the draft proposer wrote requests: {Counter(by_proposer)}"
    assert not changed, f"drafting changed requests {changed}"
    _assert_nothing_held(llm)


def test_sampled_drafts_of_a_draft_that_is_the_target_are_all_kept():
    """The verifier keeps a draft with probability p/q: where the draft is the target, q = p
    and every draft is kept (a verifier that ignored q would keep each with probability p)."""
    prompts = random_prompts(6)
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = _draft_llm(SAME_AS_TARGET)
    spec = llm.report(llm.generate(prompts, params))["speculative"]
    assert spec["draft_tokens"] > 20 and spec["acceptance_rate"] > 0.99


SEEDS = 2000
BINS = 10


def test_sampled_tokens_are_distributed_as_the_targets(monkeypatch):
    """Many seeded requests, one prompt: the second token, the first that is verified against
    a draft, is checked against the target's exact distribution, recorded without
    speculation. At temperature 0.2 about half the drafts of the shallow draft are kept, so
    both acceptance and the residual draw are at work. Each token's randomised rank under the
    target (its PIT value) must be uniform, and the first token must repeat as often as the
    target says (a draft drawn with the request's own random numbers would repeat it)."""
    prompt = [5, 17, 42, 99, 7]
    sections = {"cache": {"num_blocks": 1024, "block_size": 4},
                "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}}
    params = [SamplingParams(max_tokens=3, temperature=0.2, seed=s, ignore_eos=True)
              for s in range(SEEDS)]
    exact, distribution = {}, sampler.distribution

    def recording(row, req):
        p = distribution(row, req)
        if req.num_output_tokens == 1:
            exact[req.request_id] = p
        return p

    monkeypatch.setattr(sampler, "distribution", recording)
    plain = tiny_llm(**sections).generate([prompt] * SEEDS, params)
    monkeypatch.setattr(sampler, "distribution", distribution)
    p = [exact[o.request_id] for o in plain]

    llm = tiny_llm(**sections, speculative={"method": "draft", "num_tokens": 4, "draft": SHALLOW})
    outs = llm.generate([prompt] * SEEDS, params)
    spec = llm.report(outs)["speculative"]
    assert spec["verify_passes"] == SEEDS and 0.3 < spec["acceptance_rate"] < 0.8
    assert [o.token_ids[0] for o in outs] == [o.token_ids[0] for o in plain]   # from prefill

    gen = torch.Generator().manual_seed(0)
    pit = []
    for pi, o in zip(p, outs):
        t = o.token_ids[1]
        pit.append(float(pi[pi > pi[t]].sum() + torch.rand((), generator=gen) * pi[t]))
    counts = torch.histc(torch.tensor(pit), BINS, 0, 1)
    chi2 = float(((counts - SEEDS / BINS) ** 2).sum() / (SEEDS / BINS))
    assert chi2 < 40, f"ranks under the target are not uniform (chi2 {chi2:.0f}, 9 dof): {counts}"

    repeats = sum(o.token_ids[1] == o.token_ids[0] for o in outs)
    expected = sum(float(pi[o.token_ids[0]]) for pi, o in zip(p, plain))
    assert repeats <= expected + 6 * math.sqrt(expected) + 5, \
        f"the first token repeats {repeats} times; the target expects {expected:.1f}"


# -- configs refused ----------------------------------------------------------------------------

def _refused(monkeypatch, **sections) -> ConfigError:
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the config was refused")

    monkeypatch.setattr(loader, "model_spec", no_weights)
    with pytest.raises(ConfigError) as info:
        tiny_llm(**sections)
    return info.value


def test_method_draft_needs_a_draft_section(monkeypatch):
    exc = _refused(monkeypatch, speculative={"method": "draft"})
    assert exc.key == "speculative.draft" and "[speculative.draft]" in str(exc)


def test_a_draft_section_needs_method_draft(monkeypatch):
    exc = _refused(monkeypatch, speculative={"method": "ngram", "draft": {"num_layers": 1}})
    assert exc.key == "speculative.draft" and "ngram" in str(exc)


def test_a_draft_with_another_vocabulary_is_refused_before_weights_load(monkeypatch):
    # the random shape (weights = "random" is the target's): 49152 token ids against 512
    exc = _refused(monkeypatch, speculative={"method": "draft", "draft": {"name": "smollm2-135m"}})
    assert exc.key == "speculative.draft"
    assert "smollm2-135m-random" in str(exc) and "tiny-random" in str(exc)
    assert "vocabular" in str(exc)


def test_a_draft_backend_split_needs_both_phases(monkeypatch):
    exc = _refused(monkeypatch, speculative={"method": "draft", "draft": {
        "backend": {"prefill": {"name": "torch"}}}})
    assert exc.key == "speculative.draft.backend.prefill"


def test_draft_errors_are_keyed_under_the_draft(monkeypatch):
    name = "smollm2-135m-instruct"
    if not (cache_dir() / "models" / name / "config.json").exists():
        pytest.skip(f"{name} is not in the test cache")
    exc = _refused(monkeypatch, model={"name": name, "weights": "pretrained"},
                   speculative={"method": "draft", "draft": {"num_layers": 2}})
    assert exc.key == "speculative.draft.num_layers"
    assert str(exc).startswith("speculative.draft.num_layers: ")


def test_the_run_report_names_the_draft_model():
    from rich.console import Console

    from twophase.cli.phase_table import phase_table

    llm = _draft_llm(SHALLOW)
    rep = llm.report(llm.generate(random_prompts(3), GREEDY))
    assert rep["backend"]["draft"] == {"model": "tiny-random", "prefill": "torch", "decode": "torch",
                                       "quantization": "none"}
    console = Console(record=True, width=200)
    console.print(phase_table(rep))
    text = console.export_text()
    assert "draft model" in text and "tiny-random (none; torch prefill, torch decode)" in text


def test_a_draft_loads_when_an_engine_first_drafts_with_it(preempting_torch_tokens):
    """``twophase bench --speculative`` turns drafting on over a loaded LLM."""

    from twophase.config import DraftConfig, SpeculativeConfig
    from twophase.core.draft_proposer import DraftProposer

    llm = tiny_llm(**PREEMPTING)
    assert llm.draft is None and llm.engine.scheduler.proposer is None
    llm.reschedule(llm.config.scheduler, SpeculativeConfig(method="draft", num_tokens=4,
                                                           draft=DraftConfig(num_layers=1)))
    assert isinstance(llm.engine.scheduler.proposer, DraftProposer) and llm.draft is not None
    outs = llm.generate(random_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == preempting_torch_tokens
    assert llm.report(outs)["speculative"]["draft_tokens"] > 0
