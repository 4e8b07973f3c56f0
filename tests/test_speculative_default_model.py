"""Speculation on the default model, by n-gram lookup and by a draft model (the model's own q4
blocks on the native backend), gives token for token the greedy output without it: chat
prompts, a prompt that quotes its input, a code edit; batched, chunked, preempted (a small
pool) and again from the prefix cache."""

from __future__ import annotations

import pytest

from twophase import LLM, SamplingParams
from twophase.contract import BackendUnavailable
from twophase.measure.quality import shipped_text
from twophase.testing import assert_greedy_match, logprob_gaps

pytestmark = pytest.mark.slow
TOKENS = 40

CODE = '''def total(xs):
    s = 0
    for x in xs:
        s = s + x
    return s


def mean(xs):
    return total(xs) / len(xs)
'''


def _prompts(llm: LLM, chat_prompts: list[str]) -> list[str]:
    text = " ".join(shipped_text().split()[:120])
    return chat_prompts + [
        llm.apply_chat_template(f"Repeat this text word for word:\n\n{text}"),
        llm.apply_chat_template(f"Rename the function total to add_up in this code and show "
                                f"the whole file:\n\n{CODE}"),
    ]


@pytest.mark.exhaustive        # n-gram speculation's default lane: tests/core/test_speculative.py (tiny models)
def test_ngram_speculation_keeps_the_greedy_tokens(default_llm, default_prompts):
    spec = LLM.from_config({"model": {"name": "smollm2-135m-instruct"},
                            "cache": {"num_blocks": 24},
                            "scheduler": {"max_num_batched_tokens": 96, "max_num_seqs": 6,
                                          "admission": "greedy"},      # preempts
                            "speculative": {"method": "ngram", "num_tokens": 4}})
    prompts = _prompts(default_llm, default_prompts)
    p = SamplingParams(max_tokens=TOKENS, logprobs=2)
    want = default_llm.generate(prompts, p)
    got = spec.generate(prompts, p)
    rep = spec.report(got)
    assert rep["preemptions"] > 0 and rep["steps_by_mix"].get("mixed")
    assert rep["speculative"] and rep["speculative"]["accepted_tokens"] > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), f"prompt {i}")
    quoting = got[len(default_prompts)]
    assert quoting.metrics["num_accepted_tokens"] > TOKENS // 4, "a quote should be drafted well"
    again = spec.generate(prompts[-2:], p)                  # from the prefix cache
    assert all(o.metrics["num_cached_tokens"] > 0 for o in again)
    for g, w in zip(again, want[-2:]):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), "again")
    assert spec.engine.kv.num_free_blocks == spec.num_blocks


@pytest.mark.exhaustive        # the draft path's default lane: tests/core/test_draft.py (tiny models)
def test_draft_speculation_keeps_the_greedy_tokens(default_llm, default_prompts):
    from twophase.backends.native import NativeBackend

    try:
        NativeBackend.check_available("cpu")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    spec = LLM.from_config({"model": {"name": "smollm2-135m-instruct"},
                            "cache": {"num_blocks": 24},
                            "scheduler": {"max_num_batched_tokens": 96, "max_num_seqs": 6,
                                          "admission": "greedy"},      # preempts
                            "speculative": {"method": "draft", "num_tokens": 4, "draft": {
                                "quantization": "q4", "backend": {"name": "native"}}}})
    prompts = _prompts(default_llm, default_prompts)
    p = SamplingParams(max_tokens=TOKENS, logprobs=2)
    want = default_llm.generate(prompts, p)
    got = spec.generate(prompts, p)
    rep = spec.report(got)
    assert rep["backend"]["draft"]["decode"] == "native"
    assert rep["preemptions"] > 0 and rep["steps_by_mix"].get("mixed")
    assert rep["speculative"]["acceptance_rate"] > 0.8
    for i, (g, w) in enumerate(zip(got, want)):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), f"prompt {i}")
    again = spec.generate(prompts[-2:], p)                  # from the prefix cache
    assert all(o.metrics["num_cached_tokens"] > 0 for o in again)
    for g, w in zip(again, want[-2:]):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), "again")
    proposer = spec.engine.scheduler.proposer
    assert spec.engine.kv.num_free_blocks == spec.num_blocks
    assert proposer.kv.num_free_blocks == spec.draft.num_blocks and not proposer.shadows
