"""What a step hands out is values: deltas carry tokens, text, logprobs and the finished output,
never the engine's request; the engine forgets a request once its last delta is out; a failed
step ends its requests cleanly."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.int_backend import EOS, IntBackend, expected_tokens, greedy, make_engine

from twophase.core.outputs import Delta, RequestOutput
from twophase.core.request import Request
from twophase.errors import StepFailed


def _no_request_inside(obj, path: str = "delta") -> None:
    """Walk dataclasses, lists, tuples and dicts: no engine ``Request`` anywhere."""
    assert not isinstance(obj, Request), f"{path} is the engine's live Request"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _no_request_inside(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _no_request_inside(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _no_request_inside(v, f"{path}[{k!r}]")


def _run(eng) -> list[Delta]:
    out = []
    while eng.has_unfinished():
        out += eng.step()
    return out


def test_deltas_are_values_and_the_last_carries_the_whole_output() -> None:
    eng = make_engine(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12]}
    for rid, p in prompts.items():
        eng.add_request(p, greedy(7), rid)
    deltas = _run(eng)
    for d in deltas:
        _no_request_inside(d)
    kept = copy.deepcopy(deltas)
    eng.add_request([3, 4, 5], greedy(9), "c")            # the engine goes on writing its state
    _run(eng)
    assert deltas == kept, "a delta changed after it was handed out"
    for rid, p in prompts.items():
        mine = [d for d in deltas if d.request_id == rid]
        out = mine[-1].output
        assert isinstance(out, RequestOutput) and all(d.output is None for d in mine[:-1])
        assert [t for d in mine for t in d.token_ids] == out.token_ids == expected_tokens(p, 7)
        assert out.prompt_token_ids == p and out.finish_reason == mine[-1].finish_reason
        assert out.times is not None and len(out.times.token_times) == len(out.token_ids)
    assert not eng.requests, "finished requests must be forgotten"


def test_abort_returns_the_output_so_far() -> None:
    eng = make_engine(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    prompt = [5, 6, 7]
    eng.add_request(prompt, greedy(50), "a")
    for _ in range(4):
        eng.step()
    out = eng.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert out.token_ids == expected_tokens(prompt, 50)[:len(out.token_ids)] and out.token_ids
    assert eng.abort("a") is None and eng.kv.num_free_blocks == 32 and not eng.requests


class FailingBackend(IntBackend):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def _check(self) -> None:
        if len(self.calls) + 1 == self.fail_at:
            self.fail_at = 0                          # once
            raise RuntimeError("device lost")

    def prefill(self, batch):
        self._check()
        return super().prefill(batch)

    def decode(self, batch):
        self._check()
        return super().decode(batch)


def test_a_failed_step_ends_its_requests_and_frees_their_blocks() -> None:
    eng = make_engine(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    backend = FailingBackend(fail_at=3)
    backend.bind_kv_cache(eng.executor.prefill_backend.kv)
    eng.executor.prefill_backend = eng.executor.decode_backend = backend
    eng.add_request([5, 6, 7], greedy(20), "a")
    eng.add_request([8, 9], greedy(20), "b")
    eng.step()
    eng.step()
    with pytest.raises(StepFailed) as info:
        eng.step()
    assert sorted(info.value.request_ids) == ["a", "b"]
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not eng.has_unfinished() and not eng.requests and eng.kv.num_free_blocks == 32
    eng.add_request([3, 4], greedy(3), "c")               # the engine still serves
    assert _run(eng)[-1].output.token_ids == expected_tokens([3, 4], 3)


def test_eos_is_the_stop_reason_and_ends_the_stream() -> None:
    # a prompt whose first greedy token is EOS under the integer backend's rule
    prompt = next([a, b] for a in range(1, 97) for b in range(1, 97)
                  if expected_tokens([a, b], 5)[0] == EOS)
    eng = make_engine(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    eng.add_request(prompt, greedy(5), "x")
    (d,) = _run(eng)
    assert d.token_ids == [EOS] and d.finish_reason == "stop" and d.output.token_ids == [EOS]
    assert torch.equal(torch.tensor(d.output.token_ids), torch.tensor([EOS]))
