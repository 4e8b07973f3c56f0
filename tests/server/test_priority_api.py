"""``priority`` through the real server and the real ``openai`` client (vLLM's extra parameter,
``extra_body``): it reaches ``Engine.add_request`` for completions, chat and responses alike,
the reply is the one without it, and a priority that is not an integer is a 400 naming it."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from helpers.server import MODEL, all_blocks_free  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def priorities(default_server, monkeypatch) -> list[int]:
    """The priority of every request the engine takes while the test runs."""
    engine = default_server[0].engine
    seen: list[int] = []
    add = engine.add_request

    def spy(*args, **kwargs):
        seen.append(kwargs.get("priority", 0))
        return add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    return seen


def test_priority_reaches_the_engine(default_server, client, priorities):
    llm, url, app = default_server
    plain = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0)
    urgent = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0,
                                       extra_body={"priority": -3})
    assert urgent.choices[0].text == plain.choices[0].text
    messages = [{"role": "user", "content": "Say hi."}]
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                            extra_body={"priority": 7})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, extra_body={"priority": 2})
    client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3, extra_body={"priority": 4})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=2,
                                          extra_body={"priority": 5})
    assert len(chat.choices) == 2                      # one request: its choices share it
    assert priorities == [0, -3, 7, 2, 2, 4, 5]
    all_blocks_free(llm, app)


@pytest.mark.parametrize("bad", ["high", 1.5, True, None, [0]])
def test_a_priority_that_is_not_an_integer_is_a_400(default_server, client, priorities, bad):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": bad})
    assert e.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body={"priority": bad})
    assert e.value.body["param"] == "priority" and "priority" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={"priority": bad})
    assert e.value.body["param"] == "priority"
    assert priorities == []
    all_blocks_free(*default_server[::2])
