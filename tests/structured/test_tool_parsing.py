"""Reading tool calls back from a model's text, whole and streamed, in each chat template's
format (no model: the texts are what such models write)."""

from __future__ import annotations

import json

import pytest

from twophase.server import protocol as P
from twophase.server import tools as T

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HERMES = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}"
MISTRAL = "[AVAILABLE_TOOLS]{{ tools | tojson }}[TOOL_CALLS]{% for m in messages %}{{ m.content }}{% endfor %}"
LLAMA3 = ("{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>"
          "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}")


def _plan(template, choice="auto", parallel=True):
    body = P.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        "tool_choice": choice, "parallel_tool_calls": parallel})
    return T.plan(body, template)


@pytest.mark.parametrize("template, text", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
])
def test_auto_reads_each_templates_format(template, text):
    p = _plan(template)
    content, calls = T.parse(p, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"})]
    assert content in (None, "Let me look.")
    plain, none = T.parse(p, "It is sunny in Oslo.")
    assert plain == "It is sunny in Oslo." and none == []
    unknown, none = T.parse(p, text.replace("get_weather", "rm_rf"))      # not an offered tool
    assert none == [] and "rm_rf" in unknown


def test_auto_reads_the_json_array_a_template_without_tools_was_asked_for():
    p = _plan("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert p.format == "json" and T.parse(p, '<tool_call>{"name": "get_weather"}</tool_call>')[1] == []
    _, calls = T.parse(p, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_auto_with_a_template_of_an_unknown_format_is_plain_content():
    p = _plan("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}")
    text = '[{"name": "get_weather", "arguments": {}}]'
    assert p.format == "unknown" and T.parse(p, text) == (text, [])


def test_mistral_calls_are_read_when_the_marker_was_a_special_token():
    p = _plan(MISTRAL)
    p.marker_id = 5
    dropped = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'      # what detokenising leaves
    assert T.parse(p, dropped)[1] == []
    _, calls = T.parse(p, T.with_marker(p, dropped, [5, 1001, 1002]))
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    held = T.HeldText("mistral")
    assert held.feed("[{") == "" and held.holding


def test_held_text_streams_content_up_to_a_call():
    held = T.HeldText("hermes")
    sent = "".join(held.feed(piece) for piece in ["Let me ", "look. <to", "ol_call>", '{"name"', "}"])
    assert sent == "Let me look. " and held.holding
    plain = T.HeldText("hermes")
    sent = "".join(plain.feed(piece) for piece in ["a <to", "ast> b"])
    assert sent + plain.rest() == "a <toast> b"


def test_streamed_required_calls_grow_argument_by_argument():
    p = _plan(HERMES, "required")
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_weather","arguments":{"city":"Rome"}}]'
    stream, entries = T.CallStream(p), []
    for i in range(0, len(text), 3):
        entries += stream.feed(text[i:i + 3])
    calls: dict[int, dict] = {}
    for e in entries:
        c = calls.setdefault(e["index"], {"name": "", "arguments": ""})
        c["name"] += e.get("function", {}).get("name", "")
        c["arguments"] += e.get("function", {}).get("arguments", "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert sum(1 for e in entries if "id" in e) == 2


def test_a_template_without_tools_is_told_about_them():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]
    out = T.messages_for("{{ messages }}", messages, TOOLS)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[2]["content"] == '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert T.messages_for("{{ tools }}{{ m.tool_calls }}", messages, TOOLS)[1]["tool_calls"]


def test_tool_arguments_close_objects_that_do_not_say_otherwise():
    params = {"type": "object", "properties": {
        "trip": {"type": "object", "properties": {"to": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "additionalProperties": True},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
        "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"type": "object", "properties": {"b": {"type": "integer"}}}]},
        "ref": {"$ref": "#/$defs/Point"},
        "properties": {"type": ["object", "null"], "properties": {"x": {"type": "number"}}}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    before = json.dumps(params)
    out = T.closed(params)
    assert json.dumps(params) == before, "the tool's own schema was changed"
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["trip"]["additionalProperties"] is False
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["extra"]["additionalProperties"] is True                       # as the tool says
    assert p["labels"]["additionalProperties"] == {"type": "string"}
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert p["both"] == params["properties"]["both"]                        # allOf: as given
    assert p["ref"] == {"$ref": "#/$defs/Point"} and out["$defs"]["Point"]["additionalProperties"] is False
    assert p["properties"]["additionalProperties"] is False                 # a property named so
    assert T.closed(T.ANY_OBJECT) == {"type": "object", "additionalProperties": False}


def test_a_forced_call_is_compiled_against_the_closed_parameters():
    p = _plan(None, {"type": "function", "function": {"name": "get_weather"}})
    assert p.structured.json == {"type": "object", "additionalProperties": False}
    assert p.tools == TOOLS                              # what the template shows: the tool's own
