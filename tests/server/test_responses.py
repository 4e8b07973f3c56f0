"""``/v1/responses`` through the real server and the real ``openai`` client: greedy text equals
``LLM.generate`` of the chat-template prompt, items and instructions map onto the chat path,
tool calls and ``text.format`` answers validate, the stream's events rebuild the whole reply,
and what the server does not do is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from twophase import SamplingParams

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("uvicorn")
from helpers.server import MODEL, all_blocks_free  # noqa: E402

pytestmark = pytest.mark.slow          # the server serves the default model

ASK = "Name a colour."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
               "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                       "required": ["timezone"], "additionalProperties": False}}


def _generate(llm, messages: list[dict], max_tokens: int):
    prompt = llm.tokenizer.apply_chat_template(messages)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


def test_text_equals_generate_of_the_chat_prompt(default_server, client, default_llm):
    llm, url, app = default_server
    want = _generate(default_llm, [{"role": "user", "content": ASK}], 40)
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == want.text and want.finish_reason == "stop" and r.status == "completed"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].annotations == []
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False and r.incomplete_details is None
    same = client.responses.create(model=MODEL, max_output_tokens=40, temperature=0, truncation="disabled",
                                   store=True,            # accepted, and the reply says nothing was stored
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    assert same.output_text == want.text and same.store is False
    all_blocks_free(llm, app)


@pytest.mark.exhaustive
def test_instructions_are_a_leading_system_message(default_server, client, default_llm):
    llm, url, app = default_server
    rules = "Answer in French."
    want = _generate(default_llm, [{"role": "system", "content": rules}, {"role": "user", "content": ASK}], 24)
    r = client.responses.create(model=MODEL, instructions=rules, input=ASK, max_output_tokens=24)
    assert r.output_text == want.text and r.instructions == rules
    assert r.output_text != _generate(default_llm, [{"role": "user", "content": ASK}], 24).text
    all_blocks_free(llm, app)


@pytest.mark.exhaustive
def test_message_items_mean_the_chat_messages(default_server, client):
    """Roles (``developer`` too), text parts and an earlier reply's ``output_text`` sent back
    are the chat endpoint's messages, whole."""
    llm, url, app = default_server
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Hi!"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello! How can I help?", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a"},
                                          {"type": "input_text", "text": " colour."}]}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Name a colour."}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    got = client.responses.create(model=MODEL, input=items, max_output_tokens=30, temperature=0)
    assert got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens
    last_only = client.responses.create(model=MODEL, input=items[-1:], max_output_tokens=30, temperature=0)
    assert last_only.usage.input_tokens < got.usage.input_tokens      # every item reached the prompt
    all_blocks_free(llm, app)


def test_max_output_tokens_makes_it_incomplete(default_server, client):
    llm, url, app = default_server
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.output_text == r.output_text
    all_blocks_free(llm, app)


def test_stream_events_rebuild_the_whole_reply(default_server, client):
    llm, url, app = default_server
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40)
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == whole.output_text
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(final.output[0].id, 0, 0)}
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    all_blocks_free(llm, app)


def _valid_call(item, name: str, tool: dict) -> dict:
    assert item.type == "function_call" and item.name == name and item.status == "completed"
    assert item.call_id and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


@pytest.mark.exhaustive
def test_required_and_named_tool_choice_give_function_calls(default_server, client):
    llm, url, app = default_server
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120)
    (item,) = r.output
    assert item.name in ("get_weather", "get_time")
    _valid_call(item, item.name, WEATHER if item.name == "get_weather" else TIME)
    named = {"type": "function", "name": "get_time"}
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME], tool_choice=named,
                                max_output_tokens=120)
    (item,) = r.output
    _valid_call(item, "get_time", TIME)
    assert r.tool_choice.name == "get_time" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER, TIME], tool_choice=named,
                                 max_output_tokens=120) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == streamed.arguments == item.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [deltas]
    all_blocks_free(llm, app)


def test_function_call_round_trip_equals_chat(default_server, client):
    """A call and its output sent back as items mean what the chat messages mean."""
    llm, url, app = default_server
    ask = "What is the weather in Paris?"
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    result = '{"temperature": 21, "sky": "clear"}'
    items = [{"role": "user", "content": ask}, *first.output,      # the reply's items, as sent back
             {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    answer = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=40)
    messages = [{"role": "user", "content": ask},
                {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                    "name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    want = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=40)
    assert answer.output_text == want.choices[0].message.content
    without = client.responses.create(model=MODEL, input=[{"role": "user", "content": ask}], tools=[WEATHER],
                                      max_output_tokens=40)
    assert without.output_text != answer.output_text          # the items reached the prompt
    all_blocks_free(llm, app)


def test_text_format_json_schema_answer_validates(default_server, client):
    llm, url, app = default_server
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Make up a person.", max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = client.responses.create(model=MODEL, input="Describe a cat as a JSON object with a name and an age.",
                                max_output_tokens=80, temperature=0, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)
    all_blocks_free(llm, app)


def test_the_clients_parse_helpers_get_the_model_back(default_server, client):
    """``responses.parse`` and ``responses.stream`` with ``text_format``: the client's own
    schema from a pydantic model, its answer parsed back into one."""
    pydantic = pytest.importorskip("pydantic")

    class Cat(pydantic.BaseModel):
        name: str
        age: int

    llm, url, app = default_server
    whole = client.responses.parse(model=MODEL, input="Describe a cat.", text_format=Cat, max_output_tokens=60,
                                   temperature=0)
    assert isinstance(whole.output_parsed, Cat)
    with client.responses.stream(model=MODEL, input="Describe a cat.", text_format=Cat, max_output_tokens=60,
                                 temperature=0) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_parsed == whole.output_parsed
    all_blocks_free(llm, app)


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_abc"}, "previous_response_id"),
    ({"conversation": "conv_abc"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "image_generation_call", "id": "ig_1", "status": "completed"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"role": "user"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"instructions": ["x"]}, "instructions"),
    ({"truncation": "auto"}, "truncation"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "word " * 9000}, "input"),
])
def test_bad_requests_name_the_field(default_server, client, fields, param):
    llm, url, app = default_server
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4} | fields
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "input")}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=body["model"], input=body["input"], extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    all_blocks_free(llm, app)


@pytest.mark.parametrize("item, says", [
    ({"type": "image_generation_call", "id": "ig_1", "status": "completed"}, "'image_generation_call'"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "'input_image'"),
])
def test_an_item_it_cannot_read_is_named_in_the_refusal(default_server, client, item, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[item], max_output_tokens=4)
    assert err.value.body["param"] == "input" and says in err.value.body["message"], err.value.body


def test_unknown_model_is_404(default_server, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


def test_a_stream_given_up_is_aborted(default_server):
    llm, url, app = default_server
    body = {"model": MODEL, "input": "Count from 1 to 500.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    all_blocks_free(llm, app)
    assert llm.engine.steps.records[-1].decode_seqs <= 1
