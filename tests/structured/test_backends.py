"""The grammar lives in the sampler, so every backend, and prefill and decode on different ones,
gives the same constrained tokens (the tiny random model, its byte tokenizer)."""

from __future__ import annotations

import json
import re

import pytest
from helpers.models import PREEMPTING, tiny_llm

from twophase import SamplingParams
from twophase.structured import StructuredOutputs

pytest.importorskip("llguidance")
pytest.importorskip("onnxruntime")

SPECS = [StructuredOutputs(regex=r"[a-f]{2,6}-[0-9]{3}"),
         StructuredOutputs(json={"type": "object", "properties": {"k": {"enum": ["x", "yy", "zzz"]},
                                                                 "n": {"type": "integer", "maximum": 99}},
                                 "required": ["k", "n"], "additionalProperties": False})]
PROMPTS = ["hello there", "a much longer prompt that takes several chunks to prefill " * 3, "x"]


def test_split_backends_and_preemption_give_the_same_constrained_tokens():
    params = [SamplingParams(max_tokens=40, structured=s) for s in SPECS] + [SamplingParams(max_tokens=12)]
    want = tiny_llm().generate(PROMPTS, params)
    assert re.fullmatch(r"[a-f]{2,6}-[0-9]{3}", want[0].text)
    assert json.loads(want[1].text)["k"] in ("x", "yy", "zzz")
    split = tiny_llm(backend={"prefill": {"name": "onnxruntime"}, "decode": {"name": "torch"}}, **PREEMPTING)
    got = split.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert split.report(got)["steps_by_mix"].get("mixed")     # chunks beside decodes


def test_without_llguidance_a_structured_request_is_refused_saying_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)          # as if not installed
    (o,) = tiny_llm().generate(["hi"], SamplingParams(max_tokens=4, structured=SPECS[0]))
    assert o.finish_reason == "rejected" and "pip install llguidance" in o.error
