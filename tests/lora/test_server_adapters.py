"""Adapters through the real server and the real ``openai`` client: ``model`` names the adapter,
``/v1/models`` lists them, adapters load and unload at run time, bad loads are clear 400s and
404s, an adapter serving a request is not unloaded from under it, and ``/metrics`` shows them."""

from __future__ import annotations

import httpx
import pytest
from helpers.lora import PROMPTS

from twophase import LLM, SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from helpers.server import MODEL, serving  # noqa: E402


@pytest.fixture(scope="module")
def served(folders):
    root, refs = folders
    llm = LLM.from_config({"model": {"path": str(root / "base"), "max_loras": 2},
                           "cache": {"num_blocks": 64, "block_size": 8},
                           "lora": [{"name": "a0", "path": str(root / "a0")},
                                    {"name": "a1", "path": str(root / "a1")}]})
    with serving(llm) as (url, app):
        yield llm, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), root, refs


def test_requests_name_their_adapter_and_models_lists_them(served):
    llm, url, client, root, refs = served
    assert [m.id for m in client.models.list().data] == [MODEL, "a0", "a1"]
    assert client.models.retrieve("a1").model_extra["parent"] == MODEL
    for name in (None, "a0", "a1"):             # no tokenizer: logprobs name tokens by id
        got = client.completions.create(model=name or MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                        logprobs=0, extra_body={"min_tokens": 8})
        assert [int(t) for t in got.choices[0].logprobs.tokens] == refs[name][0][:8], name
    with pytest.raises(openai.NotFoundError, match="a0, a1"):
        client.completions.create(model="a9", prompt=PROMPTS[0], max_tokens=2)


def test_adapters_load_and_unload_at_run_time(served):
    llm, url, client, root, refs = served
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
    assert r.status_code == 200, r.text
    ref = LLM.from_config({"model": {"path": str(root / "base")}, "lora": [{"name": "a2", "path": str(root / "a2")}]})
    want = ref.generate([PROMPTS[1]], SamplingParams(max_tokens=6, lora="a2"))[0].token_ids
    got = client.completions.create(model="a2", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=0)
    assert [int(t) for t in got.choices[0].logprobs.tokens] == want == refs["a2"][1][:len(want)]
    assert "a2" in [m.id for m in client.models.list().data]
    metrics = httpx.get(url + "/metrics").text
    assert 'twophase_lora_requests_served{adapter="a2"} 1.0' in metrics
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPTS[1], max_tokens=2)


@pytest.mark.parametrize("route, body, status, param", [
    ("load", {"lora_name": "a0", "lora_path": "x"}, 400, "lora_name"),          # taken
    ("load", {"lora_name": "new", "lora_path": "/nonexistent"}, 400, "lora_path"),
    ("load", {"lora_name": MODEL, "lora_path": "x"}, 400, "lora_name"),
    ("load", {"lora_name": "", "lora_path": "x"}, 400, "lora_name"),
    ("load", {"lora_name": "new"}, 400, "lora_path"),
    ("unload", {"lora_name": "never"}, 404, "lora_name"),
])
def test_bad_adapter_requests_name_the_field(served, route, body, status, param):
    llm, url, client, root, refs = served
    r = httpx.post(f"{url}/v1/{route}_lora_adapter", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert client.completions.create(model="a0", prompt=PROMPTS[0], max_tokens=2).choices  # still up


def test_an_adapter_in_use_is_not_unloaded(served):
    llm, url, client, root, refs = served
    body = {"model": "a1", "prompt": PROMPTS[2], "max_tokens": 300, "min_tokens": 300, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status_code == 400 and "serving 1 request" in r.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert "a1" in [m.id for m in client.models.list().data]
