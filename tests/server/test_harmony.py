"""gpt-oss's harmony replies read into the chat API: the analysis channel as
``reasoning_content``, the final channel as ``content``, a commentary message to
``functions.{name}`` as a tool call; whole and streamed, as the real ``openai`` client's types
read them. The replies are what such a model writes, tokenised by a tokenizer with harmony's
special tokens (no model: random weights write no harmony)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from twophase.core.outputs import Delta, RequestOutput
from twophase.server import harmony as H
from twophase.server import protocol as P
from twophase.server import tools as T
from twophase.server.chat import ChatFormat

openai = pytest.importorskip("openai")

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if reasoning_effort %}effort={{ reasoning_effort }}{% endif %}<|start|>assistant")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
THOUGHT = "<|channel|>analysis<|message|>The user asks about Oslo. Check the weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Oslo"}<|call|>')


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from twophase.models.tokenizer import HFTokenizer

    folder = tmp_path_factory.mktemp("harmony")
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return HFTokenizer(folder)


def _format(tokenizer, tools=False, stream=False):
    body = P.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "stream": stream,
        **({"tools": TOOLS} if tools else {})})
    server = SimpleNamespace(tokenizer=tokenizer, model_name="m")
    return ChatFormat(server, body, T.plan(body, tokenizer.chat_template))   # type: ignore[arg-type]


def _output(tokenizer, text: str) -> RequestOutput:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return RequestOutput("r", None, [1, 2], ids, tokenizer.decode(ids), "stop")


def test_the_template_is_known_by_its_markers(tokenizer):
    assert H.is_harmony(tokenizer.chat_template) and not H.is_harmony("{{ messages }}<|im_start|>")


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (THOUGHT + ANSWER, "The user asks about Oslo. Check the weather.", "It is sunny in Oslo.", []),
    (THOUGHT + CALL, "The user asks about Oslo. Check the weather.", None, [("get_weather", {"city": "Oslo"})]),
    # the recipient in the role's header, as the model also writes it
    (THOUGHT + CALL.replace("assistant<|channel|>commentary to=functions.get_weather",
                            "assistant to=functions.get_weather<|channel|>commentary"),
     "The user asks about Oslo. Check the weather.", None, [("get_weather", {"city": "Oslo"})]),
    # cut by max_tokens inside the reasoning: no answer yet
    ("<|channel|>analysis<|message|>The user asks", "The user asks", None, []),
    # a call to a tool not offered stays text
    (CALL.replace("get_weather", "rm_rf"), None, '{"city": "Oslo"}', []),
])
def test_replies_are_read_into_reasoning_content_and_calls(text, reasoning, content, calls):
    reply = H.parse(text, ("get_weather",))
    assert (reply.reasoning, reply.content) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls] == calls


def test_a_calls_arguments_are_returned_as_the_model_wrote_them():
    """Arguments that are not JSON (cut short, or the model's own mistake) come back as written,
    for the client to judge, not as ``null``."""
    reply = H.parse(CALL.replace('{"city": "Oslo"}', '{"city": "Os'), ("get_weather",))
    assert reply.calls[0]["function"]["arguments"] == '{"city": "Os'


def test_a_whole_reply_as_the_openai_client_reads_it(tokenizer):
    fmt = _format(tokenizer)
    resp = openai.types.chat.ChatCompletion.model_validate(fmt.whole([_output(tokenizer, THOUGHT + ANSWER)]))
    msg = resp.choices[0].message
    assert msg.content == "It is sunny in Oslo." and resp.choices[0].finish_reason == "stop"
    assert msg.model_extra["reasoning_content"] == "The user asks about Oslo. Check the weather."
    with_tools = _format(tokenizer, tools=True)
    resp = openai.types.chat.ChatCompletion.model_validate(with_tools.whole([_output(tokenizer, THOUGHT + CALL)]))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("tools, text", [(False, THOUGHT + ANSWER), (True, THOUGHT + CALL)])
def test_a_streamed_reply_sends_reasoning_then_content_or_the_call(tokenizer, tools, text):
    """Token by token: the reasoning and the answer as they grow, never a marker, a call whole
    once its ``<|call|>`` came; the pieces add up to the whole reply's fields."""
    fmt = _format(tokenizer, tools=tools, stream=True)
    out = _output(tokenizer, text)
    chunks = [fmt.chunk(Delta("r", [t], "", []), 0) for t in out.token_ids]
    chunks.append(fmt.finish(out, 0))
    deltas = [openai.types.chat.ChatCompletionChunk.model_validate(c).choices[0] for c in chunks if c]
    reasoning = "".join((d.delta.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.delta.content or "" for d in deltas)
    calls = [c for d in deltas for c in d.delta.tool_calls or []]
    whole = H.parse(tokenizer.decode(out.token_ids, skip_special_tokens=False), ("get_weather",))
    assert reasoning == whole.reasoning and (content or None) == whole.content
    assert not any("<|" in (d.delta.content or "") for d in deltas)
    want = [("get_weather", {"city": "Oslo"})] if tools else []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    assert deltas[-1].finish_reason == ("tool_calls" if tools else "stop")


def test_a_reply_sent_back_with_its_reasoning_reaches_the_template(tokenizer):
    """An agent's loop sends the assistant's reply back as the client read it, with the
    server's ``reasoning_content`` beside the call: accepted (not an unknown field), and given
    to the template as ``thinking`` (gpt-oss's keeps it before the call) and
    ``reasoning_content`` (Qwen3's)."""
    fmt = _format(tokenizer, tools=True)
    reply = openai.types.chat.ChatCompletion.model_validate(fmt.whole([_output(tokenizer, THOUGHT + CALL)]))
    sent = reply.choices[0].message.model_dump(exclude_none=True)
    body = P.ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, sent,
        {"role": "tool", "tool_call_id": sent["tool_calls"][0]["id"], "content": "clear"}]})
    assistant = body.messages[1].for_template()
    assert assistant["thinking"] == assistant["reasoning_content"] == "The user asks about Oslo. Check the weather."
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    # a preamble beside the call (gpt-oss's template refuses both a thinking and a content on a
    # call): the template gets the preamble; Qwen3's field keeps the reasoning
    both = P.ChatMessage.model_validate({**sent, "content": "Let me check."}).for_template()
    assert "thinking" not in both and both["reasoning_content"] == assistant["thinking"]
    # a reply that stopped while reasoning (no content) comes back too
    assert P.ChatMessage.model_validate({"role": "assistant", "reasoning": "Hmm"}).for_template()["thinking"] == "Hmm"
    for field in ("reasoning_content", "reasoning"):
        with pytest.raises(Exception, match=f"only assistant messages carry {field}"):
            P.ChatMessage.model_validate({"role": "user", "content": "hi", field: "x"})
    with pytest.raises(Exception, match="reasoning_content and reasoning differ"):
        P.ChatMessage.model_validate({"role": "assistant", "content": "a", "reasoning_content": "x", "reasoning": "y"})


def test_reasoning_effort_reaches_the_template(tokenizer):
    from twophase.server.chat import prepare

    body = P.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   "reasoning_effort": "high"})
    server = SimpleNamespace(tokenizer=tokenizer, adapter_of=lambda name: None, default_max_tokens=16)
    prompt, _, _ = prepare(server, body)     # type: ignore[arg-type]
    assert prompt.endswith("effort=high<|start|>assistant")
    with pytest.raises(Exception, match="reasoning_effort"):
        P.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "reasoning_effort": "maximal"})


PUBLISHED = os.environ.get("TWOPHASE_GPT_OSS_TEMPLATE")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "default": 1},
        "hours": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
        "any": {"oneOf": [{"type": "string"}, {"type": "number"}]}}}}}
CONVERSATIONS = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, {}),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
     {"reasoning_effort": "high"}),
    ({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]}, {"reasoning_effort": "low"}),
    ({"messages": [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": "", "thinking": "Check the weather.", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                   {"role": "tool", "content": "{\"sky\": \"clear\"}"}], "tools": [WEATHER]}, {}),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "thinking": "Greet.", "content": "Hello!"},
                   {"role": "user", "content": "Bye"}]}, {}),
]


@pytest.mark.skipif(not PUBLISHED, reason="gpt-oss's published chat template is not shipped here: set "
                                          "TWOPHASE_GPT_OSS_TEMPLATE to its file to check it")
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_the_published_template_renders_as_transformers_renders_it(tokenizer, tmp_path, case):
    """The chat template gpt-oss ships (its typescript-like tool namespace, developer message,
    reasoning effort, analysis kept before a call, tool replies under the call's name) through
    this engine's template environment and through transformers', the same text."""
    import transformers

    from twophase.models.tokenizer import HFTokenizer

    template = Path(PUBLISHED).read_text()                              # type: ignore[arg-type]
    tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(template)
    ours = HFTokenizer(tmp_path)
    assert H.is_harmony(ours.chat_template)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    body, extra = CONVERSATIONS[case]
    want = theirs.apply_chat_template(body["messages"], tools=body.get("tools"), chat_template=template,
                                      tokenize=False, add_generation_prompt=True, **extra)
    assert ours.apply_chat_template(body["messages"], tools=body.get("tools"), **extra) == want


def test_a_tool_without_a_description_gets_an_empty_one():
    """OpenAI's API lets a tool omit its description; gpt-oss's template writes every one (and
    fails on a missing one), so a harmony template gets an empty one; a given one is kept."""
    tools = [{"type": "function", "function": {"name": "a"}},
             {"type": "function", "function": {"name": "b", "description": "B"}}]
    assert [t["function"]["description"] for t in H.described(tools)] == ["", "B"]
    assert "description" not in tools[0]["function"] and H.described(None) is None


@pytest.mark.skipif(not PUBLISHED, reason="gpt-oss's published chat template is not shipped here: set "
                                          "TWOPHASE_GPT_OSS_TEMPLATE to its file to check it")
def test_the_published_template_takes_a_request_whose_tool_has_no_description(tokenizer, tmp_path):
    from twophase.models.tokenizer import HFTokenizer
    from twophase.server.chat import prepare

    tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(Path(PUBLISHED).read_text())    # type: ignore[arg-type]
    body = P.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   "tools": TOOLS})
    server = SimpleNamespace(tokenizer=HFTokenizer(tmp_path), adapter_of=lambda name: None, default_max_tokens=16)
    prompt, _, _ = prepare(server, body)     # type: ignore[arg-type]
    assert "// \ntype get_weather = () => any;" in prompt
