"""Structured outputs through ``SamplingParams(structured=...)`` on the default model: every
answer validates (``jsonschema``), constrained and free rows share batches, and chunked
prefill, preemption and speculative decoding leave the tokens as they are alone."""

from __future__ import annotations

import json
import re

import pytest

from twophase import LLM, SamplingParams
from twophase.errors import InvalidSamplingParam
from twophase.structured import StructuredOutputs

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow          # the default model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
    "role": {"enum": ["admin", "user", "guest"]},
    "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
               "minItems": 2, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"], "additionalProperties": False},
    "nickname": {"type": "string"}},                        # optional
    "required": ["name", "age", "email", "role", "scores", "address"], "additionalProperties": False}
TASKS = {"type": "array", "minItems": 1, "maxItems": 4, "items": {
    "type": "object", "properties": {"title": {"type": "string"}, "done": {"type": "boolean"},
                                     "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["title", "done", "priority"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def chat(default_llm):
    return lambda text: default_llm.apply_chat_template(text)


@pytest.mark.parametrize("schema", [PERSON, pytest.param(TASKS, marks=pytest.mark.exhaustive)],
                         ids=["person", "tasks"])         # CI time: tasks' arrays in the exhaustive lane
def test_every_answer_validates_against_its_schema(default_llm, chat, schema):
    prompts = [chat("Describe a person as JSON."), chat("List my chores for today."), "Hello"]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=160, structured=StructuredOutputs(json=schema)))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_grammar_and_any_object(default_llm, chat):
    q = chat("What is the phone number of the office?")
    cases = [(StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             (StructuredOutputs(choice=["yes", "no", 'it "depends"']), lambda t: t in ("yes", "no", 'it "depends"')),
             (StructuredOutputs(grammar='start: "call " NUMBER\nNUMBER: /[0-9]{2,4}/'),
              lambda t: re.fullmatch(r"call [0-9]{2,4}", t)),
             (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for spec, ok in cases:
        (o,) = default_llm.generate([q], SamplingParams(max_tokens=64, structured=spec))
        assert ok(o.text) and o.finish_reason == "stop", (spec.kind, o.text)


def test_constrained_and_free_rows_share_a_batch(default_llm, chat):
    free = [chat("Name three colours."), "The capital of France is"]
    p_free = SamplingParams(max_tokens=24)
    p_json = SamplingParams(max_tokens=96, structured=StructuredOutputs(json=PERSON))
    alone_free = default_llm.generate(free, p_free)
    alone_json = default_llm.generate([chat("Describe a person as JSON.")], p_json)
    reqs = [(free[0], p_free), (chat("Describe a person as JSON."), p_json), (free[1], p_free)]
    mixed = default_llm.generate([r for r, _ in reqs], [p for _, p in reqs])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone_free]
    assert mixed[1].token_ids == alone_json[0].token_ids


def test_chunks_preemption_and_speculation_keep_the_constrained_tokens(default_llm, chat):
    prompts = [chat(f"Describe person number {i} as JSON, with a long address.") for i in range(3)]
    p = SamplingParams(max_tokens=64, structured=StructuredOutputs(json=PERSON))
    want = default_llm.generate(prompts, p)
    tight = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 14},
                             "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 4, "admission": "greedy"},
                             "speculative": {"method": "ngram", "num_tokens": 4}})
    got = tight.generate(prompts, p)
    rep = tight.report(got)
    assert rep["preemptions"] > 0 and rep["speculative"]["draft_tokens"] > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert tight.engine.kv.num_free_blocks == tight.num_blocks


def test_seeded_sampling_is_reproducible_and_valid(default_llm, chat):
    p = SamplingParams(max_tokens=160, temperature=1.0, seed=7, structured=StructuredOutputs(json=TASKS))
    a, b = (default_llm.generate([chat("List my chores.")], p)[0] for _ in range(2))
    assert a.token_ids == b.token_ids
    jsonschema.validate(json.loads(a.text), TASKS)


def test_bad_grammars_are_refused_by_name(default_llm):
    bad = [StructuredOutputs(json={"type": "strin"}), StructuredOutputs(regex="(a"),
           StructuredOutputs(json={"type": "string", "format": "no-such-format"}),
           StructuredOutputs(grammar="start: missing_rule")]
    for spec, why in zip(bad, ["Invalid type", "unclosed group", "Unknown format", "unknown name"]):
        (o,) = default_llm.generate(["hi"], SamplingParams(max_tokens=4, structured=spec))
        assert o.finish_reason == "rejected" and "structured" in o.error and why in o.error, o.error
    lenient = StructuredOutputs(json={"type": "string", "format": "no-such-format"}, strict=False)
    assert default_llm.generate(["hi"], SamplingParams(max_tokens=8, structured=lenient))[0].text.startswith('"')
    (o,) = default_llm.generate(["hi"], SamplingParams(max_tokens=40, structured=StructuredOutputs(
        grammar='start: a\na: "x" a')))                         # no end: the parser gives up
    assert o.finish_reason in ("error", "length") and set(o.text) <= {"x"}
    with pytest.raises(InvalidSamplingParam, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(InvalidSamplingParam, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs(regex="a+"))
    assert default_llm.engine.kv.num_free_blocks == default_llm.num_blocks
