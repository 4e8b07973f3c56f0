"""A hybrid model (Qwen3.5's Gated DeltaNet layers three in four) served disaggregated on a real
local Ray cluster: the prefill worker's prompt blocks and its state at the prompt's end cross the
object store, and the decode worker goes on. Greedy text equals one engine's, and no block stays
taken on either side. The tiny model (transformers', seeded random weights) carries the default
model's tokenizer, so the real ``openai`` client can send it text."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest
from helpers.hf_models import hf_config
from helpers.server import serving_app

from twophase import LLM, SamplingParams
from twophase.cluster import launch
from twophase.cluster.frontend import ClusterLoop
from twophase.config import load_config
from twophase.paths import cache_dir
from twophase.server.app import build_app
from twophase.server.metrics import ServerMetrics

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow          # the default model's tokenizer comes with it

TOKENS = 16


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory, default_llm):
    import torch

    cfg = hf_config("qwen3_5")
    cfg.vocab_size = default_llm.spec.arch.vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp_path_factory.mktemp("hybrid")
    model.save_pretrained(folder)
    tokenizer = cache_dir() / "models" / "smollm2-135m-instruct"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


@contextmanager
def served(folder, **cluster):
    cfg = load_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 256},
                       "cluster": {"threads": 1, **cluster}})
    c = launch.start(cfg)
    try:
        loop = ClusterLoop(c, c.tokenizer(), c.info["max_model_len"], 64)
        app = build_app(loop, loop.tokenizer, ServerMetrics(extra=c.metrics_text), "hybrid")
        with serving_app(app) as (url, _):
            yield c, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    finally:
        c.shutdown()


@pytest.mark.exhaustive        # a Ray cluster of its own; disaggregation's default lane: test_cluster.py
def test_a_hybrid_served_disaggregated_gives_one_engines_text(ray_cluster, hybrid_folder):
    prompts = ["The lighthouse keeper counted the ships that passed", "Once upon a time", "a b c d e f g"]
    one = LLM.from_config({"model": {"path": str(hybrid_folder)}, "cache": {"num_blocks": 256}})
    want = [o.text for o in one.generate(prompts, SamplingParams(max_tokens=TOKENS))]
    with served(hybrid_folder, prefill_workers=1, decode_workers=1, kv_lease_s=5.0) as (c, client):
        got = [client.completions.create(model="hybrid", prompt=p, max_tokens=TOKENS, temperature=0).choices[0].text
               for p in prompts]
        states = c.kv_states()
    assert got == want and all(len(t) > 8 for t in want), (got, want)
    assert all(s["used_blocks"] == 0 and s["leased_blocks"] == 0 for s in states.values()), states
