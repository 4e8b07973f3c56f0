"""Structured outputs and tool calls through the real server and the real ``openai`` client:
``parse(response_format=PydanticModel)`` answers validate (``jsonschema``), ``required`` and
named tool calls carry arguments that validate against the tool's parameters, streamed calls
reassemble to the whole reply, and bad input is a 400 naming the part."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
pytest.importorskip("uvicorn")
from helpers.server import MODEL, all_blocks_free  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = pytest.mark.slow


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):                                   # nested object, pattern, range
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    address: Address


class Order(BaseModel):                                    # enum, bounded array, numbers
    status: Literal["pending", "shipped", "delivered"]
    items: list[str] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=1000)
    note: str | None                                      # optional (nullable)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.mark.parametrize("model", [Person, Order])
def test_parse_gives_answers_that_validate(client, model):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": f"Make up an example {model.__name__}."}],
        response_format=model, max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
    assert isinstance(choice.message.parsed, model)


def test_json_object_on_completions_and_vllm_extras(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object about a cat:", max_tokens=60,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def _valid_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def test_required_and_named_tool_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=120, temperature=0)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content is None
    _valid_calls(m.message.tool_calls)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (c,) = r.choices[0].message.tool_calls
    assert c.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _valid_calls([c])
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                         tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    cut = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=16,
                                         tool_choice="required")        # as far as it got, as streamed
    (c,) = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason == "length" and c.function.name == "get_weather"
    assert c.function.arguments.startswith('{"city":"')                # the schema's first key


BOOK = {"type": "function", "function": {                 # no additionalProperties anywhere
    "name": "book", "description": "Book a trip",
    "parameters": {"type": "object", "required": ["trip"], "properties": {"trip": {
        "type": "object", "properties": {"from": {"type": "string", "maxLength": 20},
                                         "to": {"type": "string", "maxLength": 20}}}}}}}


def _keys_within(value, schema):
    """Every object in ``value`` holds only the keys its schema names."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(value) <= set(props), (value, sorted(props))
        for k, v in value.items():
            _keys_within(v, props[k])


@pytest.mark.parametrize("choice, temperature", [
    ({"type": "function", "function": {"name": "book"}}, 0), ({"type": "function", "function": {"name": "book"}}, 1.0),
    ("required", 0), ("required", 1.0)])
def test_tool_calls_with_open_parameters_finish_and_validate(client, choice, temperature):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[BOOK], tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=200,
                                       temperature=temperature, seed=1)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message.tool_calls
    (c,) = ch.message.tool_calls
    args = json.loads(c.function.arguments)
    jsonschema.validate(args, BOOK["function"]["parameters"])
    _keys_within(args, BOOK["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[BOOK], tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=200,
                                            temperature=temperature, seed=1, stream=True)
    text, reasons = "", []
    for chunk in stream:
        for d in chunk.choices:
            reasons.append(d.finish_reason)
            text += "".join(t.function.arguments or "" for t in d.delta.tool_calls or [] if t.function)
    assert reasons[-1] == "tool_calls" and json.loads(text) == args


def test_a_call_cut_by_max_tokens_is_length_never_a_finished_call(client):
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[BOOK], max_tokens=6,
                                           tool_choice={"type": "function", "function": {"name": "book"}},
                                           stream=stream)
        reasons = [c.finish_reason for chunk in r for c in chunk.choices] if stream \
            else [r.choices[0].finish_reason]
        assert reasons[-1] == "length" and "tool_calls" not in reasons


def test_streamed_tool_calls_reassemble_to_the_whole_reply(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reasons[-1] == "tool_calls"
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert all(c["id"] for c in calls.values())


def test_a_conversation_with_tool_results_continues(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80,
                                           tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls   # auto: plain text here


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    # what an attacker tries: slow, empty, too deep, contradicting, not an object
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format"),
    ({"structured_outputs": {"json": '{"type":"array","items":' * 1000 + "{}" + "}" * 1000}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "stop": [","]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_structured_input_is_a_400_naming_the_part(default_server, body, param):
    llm, url, app = default_server
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"], err
    all_blocks_free(llm, app)


def _doc_example() -> str:
    """The OpenAI-client example of docs/structured.md's server section."""
    text = (Path(__file__).parents[2] / "docs" / "structured.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (code,) = [b for b in blocks if "OpenAI(" in b]
    return code


def test_the_docs_server_example_runs_against_the_server_serve_makes(default_llm, capsys):
    """``twophase serve examples/quickstart.toml`` serves ``server.model_name`` or the model's id
    (``serve.local_app``); the doc's example, pointed at such a server, runs as written."""
    from helpers.server import serving_app

    from twophase.config import load_config
    from twophase.server.app import create_app

    cfg = load_config(Path(__file__).parents[2] / "examples" / "quickstart.toml")
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.server.model_name is None
    served = default_llm.model.model_id                 # the name serve gives it
    code = _doc_example()
    assert f'model="{served}"' in code, "the doc's example names a model the server does not serve"
    base_url = re.search(r'base_url="([^"]+)"', code)[1]
    with serving_app(create_app(default_llm, served, default_max_tokens=100)) as (url, app):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [served]
        exec(compile(code.replace(base_url, url + "/v1"), "docs/structured.md", "exec"), {})
        all_blocks_free(default_llm, app)
    printed = capsys.readouterr().out
    assert "name=" in printed and "age=" in printed, printed
