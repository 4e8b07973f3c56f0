"""Request priorities, as vLLM's scheduler takes them: the lower value starts first, equal ones
first come first served; the running request of the largest value is preempted first; a waiting
request of higher priority than a running one that cannot start preempts it. Over the integer
backend, so every test also checks that preempted requests end with the tokens of a lone run."""

from __future__ import annotations

import pytest
from helpers.int_backend import expected_tokens, greedy, make_engine

from twophase.core.engine import Engine
from twophase.core.request import Request
from twophase.core.sampling_params import SamplingParams
from twophase.core.waiting import WaitingQueue
from twophase.errors import RequestRejected


def step_ids(eng: Engine) -> set[str]:
    return {d.request_id for d in eng.step()}


def run_to_end(eng: Engine) -> None:
    for _ in range(1000):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError(f"not finished after 1000 steps: {eng.scheduler.running}")


def assert_outputs_alone(reqs: list[Request]) -> None:
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r.prompt_token_ids, r.params.max_tokens), r


def first_token_order(eng: Engine) -> list[str]:
    """Step to the end; the request ids in the order they got their first token."""
    order: list[str] = []
    for _ in range(1000):
        if not eng.has_unfinished():
            return order
        order += sorted(i for i in step_ids(eng) if i not in order)
    raise AssertionError("not finished after 1000 steps")


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    """One sequence at a time: the lowest value starts first, equal values in arrival order."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    priorities = {"a": 2, "b": 0, "c": 1, "d": 0, "e": 2, "f": -1}
    reqs = [eng.add_request([3 + i, 5, 7], greedy(3), rid, priority=p)
            for i, (rid, p) in enumerate(priorities.items())]
    assert first_token_order(eng) == ["f", "b", "d", "c", "a", "e"]
    assert_outputs_alone(reqs)


def test_equal_priorities_are_first_come_first_served() -> None:
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    reqs = [eng.add_request([3 + i, 5, 7], greedy(3), rid, priority=4) for i, rid in enumerate("qwerty")]
    assert first_token_order(eng) == list("qwerty")
    assert_outputs_alone(reqs)


def test_preempted_request_goes_in_front_of_its_priority_behind_higher_ones() -> None:
    queue = WaitingQueue()
    reqs = {rid: Request(rid, [1], SamplingParams(), 0.0, priority=p)
            for rid, p in [("a", 1), ("b", 0), ("c", 1), ("x", 1), ("y", 1), ("z", 2)]}
    for rid in "abc":
        queue.add(reqs[rid])
    queue.add(reqs["x"], front=True)
    queue.add(reqs["y"], front=True)          # preempted after x: started after it
    queue.add(reqs["z"], front=True)
    assert [r.request_id for r in queue] == ["b", "y", "x", "a", "c", "z"]
    queue.remove(reqs["a"])
    assert queue.popleft() is reqs["b"] and [r.request_id for r in queue] == ["y", "x", "c", "z"]


def test_pool_shortage_preempts_the_lowest_priority_first() -> None:
    """The pool runs out: the running request of the largest value goes first, although it is
    the oldest (at equal priorities the newest would); the most urgent one is never touched."""
    eng = make_engine(num_blocks=12, block_size=2, max_num_seqs=3, max_num_batched_tokens=32)
    eng.scheduler.admission.reserve = False            # admit all three: the pool runs out
    low = eng.add_request([20] * 6, greedy(12), "low", priority=2)
    eng.step()
    high = eng.add_request([21] * 6, greedy(12), "high", priority=0)
    mid = eng.add_request([22] * 6, greedy(12), "mid", priority=1)
    while eng.scheduler.num_preemptions == 0:
        eng.step()
    assert (low.num_preemptions, mid.num_preemptions, high.num_preemptions) == (1, 0, 0)
    run_to_end(eng)
    assert high.num_preemptions == 0
    assert_outputs_alone([low, high, mid])


@pytest.mark.parametrize("limit", ["max_num_seqs", "pool"])
@pytest.mark.parametrize("priority", [0, 1])
def test_urgent_request_preempts_a_flood_of_lower_priority(limit: str, priority: int) -> None:
    """Every sequence slot (or the pool, as admission reserves it) is taken by priority-1
    requests: one of priority 0 starts on the next step in place of the newest of them, which
    is recomputed later and loses nothing. At priority 1 it waits its turn and nobody is
    preempted (first come, first served)."""
    if limit == "max_num_seqs":
        eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
        flood = [eng.add_request([3 + i, 5, 7], greedy(20), f"d{i}", priority=1) for i in range(2)]
    else:       # 2 x 4 blocks at most of 8: admission keeps what they grow into from a newcomer
        eng = make_engine(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
        flood = [eng.add_request([3 + i, 5, 7], greedy(13), f"d{i}", priority=1) for i in range(2)]
    while not all(r.in_decode for r in flood):
        eng.step()
    urgent = eng.add_request(list(range(30, 42)), greedy(4), "urgent", priority=priority)
    got = step_ids(eng)
    if priority == 0:
        assert "urgent" in got, "the urgent request did not start on the next step"
        assert [r.num_preemptions for r in flood] == [0, 1], "not the newest of the flood"
    else:
        assert "urgent" not in got and eng.scheduler.num_preemptions == 0
    run_to_end(eng)
    assert_outputs_alone([*flood, urgent])


def test_priority_must_be_an_integer() -> None:
    eng = make_engine(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    for bad in (1.5, True, "1", None):
        with pytest.raises(RequestRejected, match="priority") as e:
            eng.add_request([1, 2, 3], greedy(2), priority=bad)  # type: ignore[arg-type]
        assert e.value.param == "priority"
    assert not eng.has_unfinished() and not eng.requests
    assert eng.add_request([1, 2, 3], greedy(2), priority=-5).priority == -5


def test_choices_share_their_parents_priority() -> None:
    """A request's ``n`` choices join the scheduler after it, with its priority: once they
    fill every slot, a request of higher priority preempts one of them to start."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    parent = eng.add_request(list(range(3, 12)), SamplingParams(max_tokens=6, temperature=0.0, n=3),
                             "p", priority=5)
    choices = list(parent.forks)
    assert [c.priority for c in choices] == [5, 5]
    while len(eng.scheduler.running) < 3:
        eng.step()                           # the prompt to its fork point: three running
    urgent = eng.add_request([40, 41, 42], greedy(4), "urgent", priority=0)
    assert "urgent" in step_ids(eng), "a choice of priority 5 kept the urgent request waiting"
    assert sum(r.num_preemptions for r in [parent, *choices]) == 1
    run_to_end(eng)
    assert_outputs_alone([parent, *choices, urgent])
