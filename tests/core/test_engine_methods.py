"""The engine's public methods, over the integer backend: a prompt is checked once, a step hands
out its own record, stats are values, and a raw prefill gives its lent blocks back."""

from __future__ import annotations

import pytest
from helpers.int_backend import VOCAB, greedy, make_engine

from twophase.contract import EngineLimits
from twophase.core.engine_values import PreparedPrompt
from twophase.errors import RequestRejected, TwophaseError


def counting_checks(eng, monkeypatch) -> list[list[int]]:
    """The prompts ``Admission.check`` sees from now on."""
    seen: list[list[int]] = []
    check = eng.scheduler.admission.check

    def counted(ids, params):
        seen.append(list(ids))
        return check(ids, params)

    monkeypatch.setattr(eng.scheduler.admission, "check", counted)
    return seen


def test_a_prompt_is_checked_once_whether_prepared_first_or_not(monkeypatch):
    eng = make_engine(32, 4, 4, 16)
    seen = counting_checks(eng, monkeypatch)
    prepared = eng.prepare([3, 5, 7], greedy(4))
    assert prepared == PreparedPrompt((3, 5, 7), greedy(4)) and len(seen) == 1
    eng.add_request(prepared)
    assert len(seen) == 1, "a prepared prompt was checked again"
    eng.add_request([4, 6, 8], greedy(4))
    assert seen == [[3, 5, 7], [4, 6, 8]]


@pytest.mark.parametrize("ids, params, says", [
    ([], greedy(4), "empty"),
    ([3, VOCAB], greedy(4), "outside the vocabulary"),
    (list(range(3, 63)), greedy(250), "model.max_model_len"),
])
def test_prepare_refuses_what_could_never_run_naming_the_limit(ids, params, says):
    eng = make_engine(32, 4, 4, 16)
    with pytest.raises(RequestRejected, match=says):
        eng.prepare(ids, params)
    with pytest.raises(RequestRejected, match=says):
        eng.add_request(ids, params)
    assert not eng.has_unfinished()


def test_a_prepared_prompt_keeps_the_params_it_was_checked_for():
    eng = make_engine(32, 4, 4, 16)
    prepared = eng.prepare([3, 5, 7], greedy(4))
    assert eng.add_request(prepared, greedy(4)).params == greedy(4)      # equal: fine
    with pytest.raises(ValueError, match="prepared for other SamplingParams"):
        eng.add_request(prepared, greedy(200))


def test_each_step_hands_out_its_own_record_and_stats_are_values():
    eng = make_engine(32, 4, 4, 16)
    assert eng.step_with_record().record is None                         # nothing to run
    eng.add_request([3, 5, 7, 9, 11], greedy(3))
    before = eng.stats()
    assert (before.waiting, before.running, before.used_blocks, before.num_steps) == (1, 0, 0, 0)
    result = eng.step_with_record()
    assert result.record is not None and result.record.prefill_tokens == 5
    assert eng.step_records() == [result.record]
    after = eng.stats()
    assert (after.waiting, after.running, after.num_steps) == (0, 1, 1)
    assert after.used_blocks == 2 and after.free_blocks == after.total_blocks - 2 == 30
    assert before.waiting == 1, "a snapshot must not change after it was taken"
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().free_blocks == 32 and eng.stats().num_steps == 3


def test_reset_stats_forgets_the_step_log_and_prefix_counts():
    eng = make_engine(32, 4, 4, 16)
    for _ in range(2):                        # the second run hits the first one's prefix
        eng.add_request([3, 5, 7, 9, 11, 13, 15, 17, 19], greedy(2))
        while eng.has_unfinished():
            eng.step()
    s = eng.stats()
    assert s.num_steps > 0 and s.prefix_hits > 0 and 0 < s.prefix_hit_rate <= 1
    eng.reset_stats()
    s = eng.stats()
    assert (s.num_steps, s.prefix_queries, s.prefix_hits, s.prefix_hit_rate) == (0, 0, 0, 0.0)
    assert eng.step_records() == []


def test_limits_are_the_schedulers():
    assert make_engine(32, 4, 4, 16, max_model_len=128).limits == EngineLimits(4, 16, 128)


def test_prefill_logits_lends_blocks_for_the_call_only():
    eng = make_engine(32, 4, 4, 16)
    ids = list(range(3, 40))
    chunks = list(eng.prefill_logits(ids, chunk=16))
    assert [start for start, _ in chunks] == [0, 16, 32]
    assert [tuple(x.shape) for _, x in chunks] == [(16, VOCAB), (16, VOCAB), (5, VOCAB)]
    assert eng.stats().free_blocks == 32 and eng.stats().prefix_queries == 0
    with pytest.raises(TwophaseError, match="KV blocks"):
        list(eng.prefill_logits(list(range(3, 3 + 4 * 33))))
    eng.add_request([3, 5, 7], greedy(2))
    with pytest.raises(TwophaseError, match="busy"):
        list(eng.prefill_logits(ids))


def test_schedule_batch_builds_the_phase_asked_for():
    eng = make_engine(32, 4, 4, 16)
    eng.add_request([3, 5, 7], greedy(8))
    eng.step()                                       # in decode now
    eng.add_request([4, 6, 8, 10, 12], greedy(8))
    out, batch = eng.schedule_batch("mixed")
    assert len(out.decodes) == 1 and len(out.prefills) == 1
    assert batch.query_lens == [1, 5]                # the decode rides first, as one token
