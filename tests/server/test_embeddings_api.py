"""``POST /v1/embeddings`` for real: the ``openai`` client (float and base64) against the default
server, vectors equal to HF's pooled hidden states and to ``LLM.embed``; embeddings served beside
generation by the same engine; bad input is a 400 naming the field, and every block is freed."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest
import torch
from helpers.hf_models import hf_pooled

from twophase import PoolingParams, SamplingParams
from twophase.core.pooling import PoolingConfig

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow          # the server serves the default model
pytest.importorskip("uvicorn")
from helpers.server import all_blocks_free  # noqa: E402

MODEL = "smollm2"
TEXTS = ["The capital of France is Paris.", "def add(a, b): return a + b", "Hi"]
ATOL = 1e-4


def close(got, want: torch.Tensor) -> bool:
    got = torch.as_tensor(got, dtype=torch.float32)
    return got.shape == want.shape and (got - want).abs().max().item() < ATOL


def test_openai_client_embeddings_equal_transformers_and_llm_embed(default_server, client, default_llm,
                                                                   default_hf_base):
    llm, url, app = default_server
    ids = [default_llm.tokenizer.encode(t) for t in TEXTS]
    want = [hf_pooled(default_hf_base, i, "last", False) for i in ids]   # no pooling config: last
    ours = [o.embedding for o in default_llm.embed(TEXTS)]
    # the client asks for base64 unless told otherwise, and decodes it to floats itself
    for fmt in ({"encoding_format": "float"}, {}):
        got = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)
        assert [d.index for d in got.data] == [0, 1, 2] and got.object == "list" and got.model == MODEL
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
        for d, w, o in zip(got.data, want, ours):
            assert d.object == "embedding" and close(d.embedding, w) and close(d.embedding, torch.tensor(o))
    b64 = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert isinstance(b64, str)                           # asked for explicitly: the client keeps the string
    assert close(torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.float32), want[0])
    for given in (ids, ids[1]):                           # token ids: a batch, and one input
        one = client.embeddings.create(model=MODEL, input=given, dimensions=llm.model.arch.hidden_size)
        assert all(close(d.embedding, w) for d, w in zip(one.data, want if given is ids else want[1:2]))
    all_blocks_free(llm, app)


def test_pooling_and_normalize_beyond_openai(default_server, client, default_hf_base, default_llm):
    llm, url, app = default_server
    ids = default_llm.tokenizer.encode(TEXTS[0])
    got = client.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"pooling": "mean", "normalize": True})
    assert close(got.data[0].embedding, hf_pooled(default_hf_base, ids, "mean", True))
    all_blocks_free(llm, app)


def test_embeddings_join_the_steps_of_generation(default_server, default_llm, default_hf_base):
    """A stream generates while embeddings arrive: each gets what it gets alone."""
    llm, url, app = default_server
    prompt = "Count from 1 to 20:"
    want_text = default_llm.generate([prompt], SamplingParams(max_tokens=32))[0].text
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    steps_before = len(llm.engine.step_records())

    async def generate() -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def embed(text: str):
        await asyncio.sleep(0.05)
        return (await aclient.embeddings.create(model=MODEL, input=text)).data[0].embedding

    async def both():
        return await asyncio.wait_for(asyncio.gather(generate(), *(embed(t) for t in TEXTS)), 120)

    text, *vectors = asyncio.run(both())
    assert text == want_text
    for t, v in zip(TEXTS, vectors):
        assert close(v, hf_pooled(default_hf_base, default_llm.tokenizer.encode(t), "last", False))
    records = llm.engine.step_records()[steps_before:]
    assert any(r.prefill_tokens and r.decode_seqs for r in records)      # embeddings beside decodes
    all_blocks_free(llm, app)


@pytest.mark.parametrize("body, param, says", [
    ({"model": MODEL, "input": ""}, "input", "empty"),
    ({"model": MODEL, "input": []}, "input", None),
    ({"model": MODEL, "input": [[]]}, "input", None),
    ({"model": MODEL, "input": ["fine", ""]}, "input", "input[1]: the input is empty"),
    ({"model": MODEL, "input": [1, 10 ** 9]}, "input", "outside the vocabulary"),
    ({"model": MODEL, "input": [1, -1]}, "input", None),
    ({"model": MODEL, "input": "word " * 9000}, "input", "exceeds the model's context"),
    ({"model": MODEL, "input": "hi", "dimensions": 8}, "dimensions", "not truncated"),
    ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ({"model": MODEL, "input": "hi", "pooling": "max"}, "pooling", None),
    ({"model": MODEL, "input": "hi", "truncate": 5}, "truncate", "unsupported"),
    ({"model": "gpt-4", "input": "hi"}, "model", "does not exist"),
])
def test_bad_input_is_a_400_naming_the_field(default_server, body, param, says):
    llm, url, app = default_server
    r = httpx.post(url + "/v1/embeddings", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and (says is None or says in err["message"]), err
    all_blocks_free(llm, app)


def test_a_pooling_the_model_needs_but_is_not_computed_is_a_400(default_server, client, default_llm,
                                                                 monkeypatch):
    """A model whose config pools by max: the model's pooling is refused naming ``pooling``;
    an explicit one is served."""
    llm, url, app = default_server
    monkeypatch.setattr(llm.engine.pooler, "model", PoolingConfig("last", True, "max"))
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert info.value.status_code == 400 and info.value.body["param"] == "pooling"
    assert "'max'" in info.value.body["message"]
    got = client.embeddings.create(model=MODEL, input="hi", extra_body={"pooling": "mean"})
    [want] = default_llm.embed("hi", PoolingParams("mean"))
    assert close(got.data[0].embedding, torch.tensor(want.embedding))
    all_blocks_free(llm, app)
