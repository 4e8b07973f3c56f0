"""``n`` choices, ``best_of``, ``echo`` and prompt log-probabilities through the real server and
the real ``openai`` client: each choice equals the request sent alone with its seed, an echoed
prompt's log-probabilities are the engine's (checked against HF in the core tests), and every
block is free afterwards."""

from __future__ import annotations

import httpx
import pytest

from twophase import SamplingParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow          # the server serves the default model
pytest.importorskip("uvicorn")
from helpers.server import all_blocks_free  # noqa: E402

MODEL = "smollm2"
PROMPT = "Once upon a time, in a small village by the sea,"
SAMPLED = dict(model=MODEL, max_tokens=10, temperature=1.0)


def _alone(client, seeds, **kwargs) -> list[str]:
    return [client.completions.create(**SAMPLED, seed=s, **kwargs).choices[0].text for s in seeds]


def test_n_choices_equal_the_requests_sent_one_by_one(default_server, client):
    llm, url, app = default_server
    want = _alone(client, [5, 6, 7], prompt=PROMPT)
    got = client.completions.create(**SAMPLED, prompt=PROMPT, n=3, seed=5)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == want and len(set(want)) > 1
    assert got.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))     # the prompt once
    assert got.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for chunk in client.completions.create(**SAMPLED, prompt=PROMPT, n=3, seed=5, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want
    two = client.completions.create(**SAMPLED, prompt=[PROMPT, "1, 2, 3,"], n=2, seed=5)
    assert [c.text for c in two.choices[:2]] == want[:2]       # prompt p's i-th: p * n + i
    assert [c.text for c in two.choices[2:]] == _alone(client, [5, 6], prompt="1, 2, 3,")
    all_blocks_free(llm, app)


def test_chat_n_choices_equal_the_requests_sent_one_by_one(default_server, client):
    llm, url, app = default_server
    messages = [{"role": "user", "content": "Name a colour."}]
    want = [client.chat.completions.create(**SAMPLED, messages=messages, seed=s).choices[0].message.content
            for s in (3, 4)]
    got = client.chat.completions.create(**SAMPLED, messages=messages, n=2, seed=3)
    assert [c.message.content for c in got.choices] == want
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**SAMPLED, messages=messages, n=2, seed=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == want
    all_blocks_free(llm, app)


def test_best_of_returns_the_likeliest_choices(default_server, client):
    llm, url, app = default_server
    alone = [client.completions.create(**SAMPLED, prompt=PROMPT, seed=s, logprobs=0).choices[0]
             for s in range(9, 13)]
    ranked = sorted(alone, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    got = client.completions.create(**SAMPLED, prompt=PROMPT, seed=9, n=2, best_of=4)
    assert [c.text for c in got.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in got.choices] == [0, 1]
    assert all(c.logprobs is None for c in got.choices)        # ranked by them, not asked for
    assert got.usage.completion_tokens == 40                   # every candidate was computed
    all_blocks_free(llm, app)


def test_echo_returns_the_prompt_and_its_logprobs(default_server, client, default_llm):
    """lm-evaluation-harness's loglikelihood request: ``echo``, ``logprobs``, ``max_tokens = 0``."""
    llm, url, app = default_server
    ids = default_llm.tokenizer.encode(PROMPT)
    ref = default_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    scored = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    (c,) = scored.choices
    lp = c.logprobs
    assert c.text == PROMPT and scored.usage.completion_tokens == 0
    assert lp.tokens == [default_llm.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(abs(got - want[t]) < 1e-4 for got, want, t in zip(lp.token_logprobs[1:], ref[1:], ids[1:]))
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    more = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4,
                                     temperature=0)
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert more.choices[0].text == PROMPT + alone.choices[0].text
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 4
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0, stream=True) if ch.choices)
    assert streamed == more.choices[0].text
    all_blocks_free(llm, app)


def test_prompt_logprobs_as_vllm_returns_them(default_server, client, default_llm):
    llm, url, app = default_server
    ids = default_llm.tokenizer.encode(PROMPT)
    ref = default_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                    extra_body={"prompt_logprobs": 1})
    plp = got.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(abs(e[str(t)]["logprob"] - r[t]) < 1e-4 for e, r, t in zip(plp[1:], ref[1:], ids[1:]))
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    all_blocks_free(llm, app)


@pytest.mark.parametrize("body, param", [
    ({"echo": True}, "echo"),
    ({"n": 17}, "n"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_chat_choices_get_a_400_naming_the_field(default_server, body, param):
    llm, url, app = default_server
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    all_blocks_free(llm, app)


def test_a_client_gone_mid_stream_frees_every_choice(default_server):
    llm, url, app = default_server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "n": 4, "temperature": 1.0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    all_blocks_free(llm, app)
