"""Nothing a client sends takes the server down: hostile and malformed requests get an OpenAI
error object, an engine failure ends only the requests it concerns (a stream gets an error event,
then ``[DONE]``), memory does not grow with what unauthenticated clients send, and the server
stays up for the next client. A real server on the tiny random model."""

from __future__ import annotations

import gc
import json
import logging
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from helpers.server import MODEL, all_blocks_free, serving  # noqa: E402

from twophase import LLM, SamplingParams  # noqa: E402


def _tiny() -> LLM:
    return LLM.from_config({"model": {"name": "tiny", "weights": "random"},
                            "cache": {"num_blocks": 128}})


@pytest.fixture(scope="module")
def tiny_server():
    llm = _tiny()
    with serving(llm, max_body_bytes=64 << 10, default_max_tokens=5) as (url, app):
        yield llm, url, app


def _post(url: str, body, route: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + route, content=content, timeout=30,
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def _events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def _ok(url: str) -> None:
    """The server still serves: health, and a request end to end."""
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = _post(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": "hi", "seed": 2 ** 64}, "seed"),
    ({"model": MODEL, "prompt": "hi", "seed": -(2 ** 63) - 1}, "seed"),
    ('{"model": "smollm2", "prompt": "a \\ud800 b"}', "prompt"),          # a lone surrogate
    ({"model": MODEL, "prompt": "hi", "max_tokens": "4"}, "max_tokens"),  # never coerced
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    ('{"model": "smollm2", "prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"model": "smollm2", "prompt": "hi", "top_p": Infinity}', "top_p"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ({"model": MODEL, "prompt": [5, -1]}, "prompt"),
    ({"model": MODEL, "prompt": [5, 512]}, "prompt"),                      # outside the vocabulary
    ({"model": MODEL, "prompt": []}, "prompt"),
])
def test_hostile_values_are_400s_and_the_engine_goes_on(tiny_server, body, param):
    llm, url, app = tiny_server
    r = _post(url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    _ok(url)
    all_blocks_free(llm, app)


@pytest.mark.parametrize("body, route, param, cap", [
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 1000}, "/v1/completions", "stop", "16"),
    ({"model": MODEL, "prompt": "hi", "stop": "x" * 300}, "/v1/completions", "stop", "256"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x" * 300]}, "/v1/completions", "stop", "256"),
    ({"model": MODEL, "prompt": ["hi"] * 65}, "/v1/completions", "prompt", "64"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 6}, "/v1/completions", "logprobs", "5"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 1025}, "/v1/chat/completions",
     "messages", "1024"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21},
     "/v1/chat/completions", "top_logprobs", "20"),
])
def test_a_value_past_its_cap_is_a_400_that_names_the_cap(tiny_server, body, route, param, cap):
    r = _post(tiny_server[1], body, route)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and cap in err["message"], err


def test_hostile_chat_messages_are_400s(tiny_server):
    llm, url, app = tiny_server
    bad = [
        '{"model": "smollm2", "messages": [{"role": "user", "content": "\\udfff"}]}',
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 1025},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                     "image_url": {"url": "x"}}]}]},
        {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
    ]
    for body in bad:
        r = _post(url, body, "/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    _ok(url)


def test_bodies_past_the_limit_are_413_declared_or_streamed(tiny_server):
    llm, url, app = tiny_server
    big = json.dumps({"model": MODEL, "prompt": "x" * (80 << 10)})
    r = _post(url, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                              # no Content-Length: counted as it arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192].encode()
    r = httpx.post(url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    _ok(url)


def test_a_prompt_longer_than_the_context_is_refused_without_tokenising_it(tiny_server):
    llm, url, app = tiny_server
    calls = []
    tok = llm.tokenizer
    encode = tok.encode
    tok.encode = lambda text: calls.append(len(text)) or encode(text)
    try:
        r = _post(url, {"model": MODEL, "prompt": "y" * 60_000})          # > 2,048 tokens for sure
    finally:
        tok.encode = encode
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert calls == [], "a prompt that cannot fit was tokenised"
    assert not llm.engine.requests
    all_blocks_free(llm, app)


def test_metrics_label_routes_not_raw_paths_and_each_request_is_logged(tiny_server, caplog):
    llm, url, app = tiny_server
    caplog.set_level("INFO", logger="twophase.access")
    httpx.get(url + "/health")
    deadline = time.monotonic() + 5           # the line is written as the response completes
    while not any('"GET /health" 200' in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any('"GET /health" 200' in r.getMessage() for r in caplog.records)
    before = len(httpx.get(url + "/metrics").text)
    for i in range(200):
        httpx.get(f"{url}/no/such/path/{i}")
    text = httpx.get(url + "/metrics").text
    assert len(text) < before + 2000, "each unknown path added a series"
    assert 'route="unmatched",status="404"' in text
    assert 'twophase_time_per_output_token_seconds_bucket{le="0.001"}' in text


def test_an_unknown_model_is_404_and_one_model_can_be_retrieved(tiny_server):
    llm, url, app = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = _post(url, {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openai_compatible_extras(tiny_server):
    llm, url, app = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    # a batch of prompts: one choice each, in order, as each alone would give
    batch = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [9, 10]], max_tokens=4)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4).choices[0].text
             for p in ([5, 6, 7], [9, 10])]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == alone
    stream = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=4).choices[0].text
            for p in ("ab", "cd")]
    assert [texts[0], texts[1]] == solo
    # content parts, the developer role, vLLM's extra sampling parameters
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=3,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    assert chat.choices[0].finish_reason in ("stop", "length")
    # no max_tokens: the server's one default (server.default_max_tokens, 5 here)
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7])
    assert out.usage.completion_tokens == 5 or out.choices[0].finish_reason == "stop"
    all_blocks_free(llm, app)


def test_authorization_header_edge_cases():
    llm = _tiny()
    with serving(llm, api_key="sekret") as (url, app):
        for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer", b"Basic sekret"):
            r = httpx.get(url + "/v1/models", headers={"Authorization": value})
            assert r.status_code == 401, (value, r.status_code)
        for value in ("bearer sekret", "BEARER sekret", "Bearer  sekret"):
            assert httpx.get(url + "/v1/models", headers={"Authorization": value}).status_code == 200


def _slowed(llm: LLM, seconds: float) -> LLM:
    """Decode steps that take ``seconds`` at least: a request stays in flight for a while."""
    decode = llm.decode_backend.decode

    def slow(batch):
        time.sleep(seconds)
        return decode(batch)

    llm.decode_backend.decode = slow
    return llm


def test_gauges_follow_aborts_and_a_full_queue_says_when_to_retry():
    llm = _slowed(_tiny(), 0.005)
    with serving(llm, max_queue=1) as (url, app):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1500, "min_tokens": 1500,
                "stream": True}                    # random weights: EOS must not end it early
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()              # held: a dropped iterator closes the stream
            next(line for line in lines if line.startswith("data:"))
            busy = _post(url, {"model": MODEL, "prompt": [5], "max_tokens": 2})
            assert busy.status_code == 503 and busy.headers.get("retry-after") == "1"
        all_blocks_free(llm, app)
        text = httpx.get(url + "/metrics").text
        assert "twophase_requests_running 0.0" in text and "twophase_kv_blocks_used 0.0" in text
        mem = llm.memory
        assert f"twophase_kv_tokens {float(mem['kv_tokens'])}" in text
        assert f"twophase_max_concurrency {float(mem['max_concurrency'])}" in text


def test_an_engine_failure_ends_its_streams_with_an_error_and_the_server_goes_on():
    llm = _tiny()
    backend = llm.decode_backend
    fail = {"prefill": 0, "decode": 0}

    def flaky(name):
        call = getattr(backend, name)

        def run(batch):
            if fail[name]:
                fail[name] -= 1
                raise RuntimeError("device lost")
            return call(batch)
        return run

    backend.prefill, backend.decode = flaky("prefill"), flaky("decode")
    fatal = []
    with serving(llm, on_fatal=fatal.append) as (url, app):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 50, "min_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            fail["decode"] = 1
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "engine_error" and "device lost" in err["message"]
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:   # its own events
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            fail["decode"] = 1
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data:")]
        assert rest[-1]["type"] == "error" and rest[-1]["code"] == "engine_error", rest[-1]
        assert "device lost" in rest[-1]["message"] and "response.completed" not in [e["type"] for e in rest]
        r = _post(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200, "one failed step must not end the server"
        # a new prompt that fails its first step is ended alone, however often: it may be its fault
        fail["prefill"] = 5
        for _ in range(5):
            r = _post(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert httpx.get(url + "/health").status_code == 200 and not fatal
        # running requests failing step after step: the engine is declared stopped
        fail["decode"] = 10 ** 6
        for _ in range(3):
            _post(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "min_tokens": 3})
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "stopped" in health.json()["error"]
        assert len(fatal) == 1 and "in a row failed" in str(fatal[0])   # serve exits non-zero on it
        r = _post(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_speculation_streams_the_kept_tokens_of_a_step_together():
    cfg = {"model": {"name": "tiny", "weights": "random"}, "cache": {"num_blocks": 128}}
    prompt = [5, 6, 7, 8, 9, 10] * 4                    # random weights repeat: drafts are kept
    want = LLM.from_config(cfg).generate([prompt], SamplingParams(max_tokens=40, min_tokens=40))[0].token_ids
    llm = LLM.from_config({**cfg, "speculative": {"method": "ngram", "num_tokens": 4}})
    with serving(llm) as (url, app):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "min_tokens": 40, "logprobs": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            events = [e for e in _events(r) if isinstance(e, dict) and e["choices"]]
        per_chunk = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events
                     if e["choices"][0]["logprobs"] and e["choices"][0]["logprobs"]["tokens"]]
        assert sum(per_chunk) == len(want) and max(per_chunk) > 1, per_chunk
        assert "".join(e["choices"][0]["text"] for e in events) == llm.tokenizer.decode(want)
        text = httpx.get(url + "/metrics").text
        kept = next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("twophase_spec_accepted_tokens_total "))
        assert kept == sum(per_chunk) - len(per_chunk)



def test_a_non_streamed_client_that_leaves_is_aborted_without_a_traceback(caplog):
    llm = _slowed(_tiny(), 0.005)
    caplog.set_level("WARNING")
    with serving(llm) as (url, app):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1500, "min_tokens": 1500}
        with pytest.raises(httpx.ReadTimeout):          # gone long before 1,500 tokens
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        all_blocks_free(llm, app)                       # aborted: it would take ~8 s to finish
        deadline = time.monotonic() + 5
        while 'status="499"' not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)
        gc.collect()                                    # an unread future complains when freed
        _ok(url)
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in logged if "never retrieved" in r.getMessage() or r.exc_info], \
        [r.getMessage() for r in logged]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                   "/detokenize"])
@pytest.mark.parametrize("body, kind", [
    ("[]", "an array"), ('[{"model": "smollm2", "prompt": "hi"}]', "an array"),
    ('"hi"', "a string"), ("3", "a number"), ("1.5", "a number"), ("null", "null"),
    ("true", "a boolean"), ("", "empty"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_that_says_so(tiny_server, route, body, kind):
    r = _post(tiny_server[1], body, route)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "must be a JSON object" in message and kind in message, message
    assert "None" not in message


def test_a_body_not_sent_as_json_is_a_400_that_names_the_content_type(tiny_server):
    body = json.dumps({"model": MODEL, "prompt": "hi"})
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = httpx.post(tiny_server[1] + "/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "Content-Type: application/json" in message and headers["content-type"] in message


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", 1e308, "[0, 2]"), ("temperature", 2.5, "[0, 2]"), ("temperature", -0.1, ">= 0"),
    ("top_p", 0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -1e300, "[-2, 2]"),
    ("min_p", 1.5, "[0, 1]"), ("repetition_penalty", 0, "> 0"),
])
def test_absurd_sampling_values_are_400s_that_name_the_field_and_the_range(tiny_server, field, value,
                                                                          allowed):
    llm, url, app = tiny_server
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(url, {"model": MODEL, **body, field: value}, route)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"] and allowed in err["message"], err
    with pytest.raises(ValueError, match=f"{field} .*{re.escape(allowed)}"):   # the Python API too
        SamplingParams(**{field: value})
    _ok(url)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
def test_sampling_params_refuse_non_finite_floats(field):
    for value in (float("inf"), float("-inf"), float("nan"), 10 ** 400):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be a finite number"):
            SamplingParams(**{field: value})


def test_the_edges_of_the_sampling_ranges_are_served(tiny_server):
    llm, url, app = tiny_server
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 2, "top_p": 1,
            "presence_penalty": -2, "frequency_penalty": 2, "min_p": 1, "repetition_penalty": 5}
    r = _post(url, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param, says", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be at least 1"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs a schema"),
])
def test_a_chat_400_names_the_field_the_client_sent(tiny_server, body, param, says):
    r = _post(tiny_server[1], {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
              "/v1/chat/completions")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_too_long_for_the_context_names_the_field_the_client_sent(tiny_server, field, stream):
    llm, url, app = tiny_server
    r = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 10 ** 6,
                    "stream": stream}, "/v1/chat/completions")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "prompt_rejected" and f"{field} (1000000)" in err["message"], err
    assert field == "max_tokens" or "max_tokens" not in err["message"], err
    _ok(url)
    all_blocks_free(llm, app)


def test_top_k_minus_one_is_off_as_in_vllm(tiny_server):
    llm, url, app = tiny_server
    r = _post(url, {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "top_k": -1})
    assert r.status_code == 200, r.text
    assert _post(url, {"model": MODEL, "prompt": [5, 6], "top_k": -2}).json()["error"]["param"] == "top_k"
