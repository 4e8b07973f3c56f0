"""``/tokenize`` and ``/detokenize`` through the real server: a prompt's ids are HF's encoding of
it, a chat's are HF's chat template's tokens (with and without the generation prompt), ids read
back as the text they came from, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
from helpers.server import MODEL  # noqa: E402

pytestmark = pytest.mark.slow          # the server serves the default model

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Zürich ?"},
        {"role": "assistant", "content": "In Switzerland."}, {"role": "user", "content": "And Bern?"}]


@pytest.fixture(scope="module")
def hf(default_server):
    """HF's tokenizer of the served model, read from the same folder by transformers."""
    return transformers.AutoTokenizer.from_pretrained(default_server[0].model.weights)


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=30)


def test_a_prompt_tokenizes_as_hf_encodes_it_and_reads_back(default_server, hf):
    llm, url, app = default_server
    text = "The café's naïve owner counted 12,345 croissants."
    r = _post(url, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == hf(text).input_ids == llm.tokenizer.encode(text)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == llm.max_model_len
    assert _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        hf(text, add_special_tokens=False).input_ids
    back = _post(url, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    last = len(hf) - 1                                  # the vocabulary's last id, then one past it
    assert _post(url, "/detokenize", {"tokens": [last]}).json()["prompt"] == hf.decode([last])
    past = _post(url, "/detokenize", {"tokens": [5, last + 1]})
    assert past.status_code == 400 and past.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("generation", [True, False])
def test_messages_tokenize_as_the_chat_template_renders_them(default_server, hf, generation):
    llm, url, app = default_server
    body = {"messages": CHAT} | ({} if generation else {"add_generation_prompt": False})
    got = _post(url, "/tokenize", body).json()
    want = hf.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=True, return_dict=True)
    assert got["tokens"] == list(want["input_ids"]) and got["count"] == len(got["tokens"])
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=False)
    assert _post(url, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"] == rendered
    assert rendered.endswith("<|im_start|>assistant\n") == generation


def test_a_chat_counts_what_the_chat_endpoint_feeds_the_model(default_server, client):
    llm, url, app = default_server
    counted = _post(url, "/tokenize", {"model": MODEL, "messages": CHAT}).json()["count"]
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert reply.usage.prompt_tokens == counted


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
    ("/detokenize", {"tokens": [5, 10 ** 12]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(default_server, route, body, param):
    r = _post(default_server[1], route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_another_model_is_404(default_server):
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        r = _post(default_server[1], route, {"model": "gpt-4o"} | body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
