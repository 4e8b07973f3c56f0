"""Engines on a real local Ray cluster behind the real HTTP server, through the real ``openai``
client: replicas (Serve, prefix-affine routing) and disaggregated prefill/decode (K/V pulled
through the object store). Greedy text equals one engine's; faults (a killed replica, a prefill
worker killed mid-transfer, clients gone during the transfer) end cleanly and leave no block
taken on either side."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

import httpx
import pytest

from twophase import SamplingParams
from twophase.cluster import launch
from twophase.cluster.board import POST_EVERY_S
from twophase.cluster.frontend import ClusterLoop
from twophase.config import load_config
from twophase.core.detokenizer import IncrementalDetokenizer
from twophase.server.app import build_app
from twophase.server.metrics import ServerMetrics
from twophase.structured import StructuredOutputs

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow          # replicas and workers load the default model
from helpers.server import serving_app  # noqa: E402

MODEL = "smollm2"
GREEDY_TOKENS = 24


@contextmanager
def cluster_server(**cluster):
    cfg = load_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 256},
                       "cluster": {"threads": 1, **cluster}})
    c = launch.start(cfg)
    try:
        loop = ClusterLoop(c, c.tokenizer(), c.info["max_model_len"], 64)
        app = build_app(loop, loop.tokenizer, ServerMetrics(extra=c.metrics_text), MODEL)
        with serving_app(app) as (url, app):
            yield c, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    finally:
        c.shutdown()


def metric(url: str, name: str) -> dict[str, float]:
    """``name``'s value by replica label, from /metrics."""
    text = httpx.get(url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}{{replica="([^"]+)"}} (\S+)$', text, re.M)}


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return result


def expected(default_llm, prompts: list[str]) -> list[str]:
    return [o.text for o in default_llm.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS))]


def streamed(client, prompt: str, **kw) -> str:
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS,
                                       temperature=0, stream=True, **kw)
    return "".join(c.choices[0].text for c in stream if c.choices)


# -- replicas -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicas(ray_cluster):
    with cluster_server(replicas=2) as served:
        yield served


def test_replicas_give_one_engines_greedy_text_streaming(replicas, default_llm, default_prompts):
    c, url, client = replicas
    prompts = [default_prompts[0], default_prompts[3]]     # a chat prompt and a raw one (CI time)
    want = expected(default_llm, prompts)
    assert [streamed(client, p) for p in prompts] == want
    whole = client.completions.create(model=MODEL, prompt=default_prompts[0],
                                      max_tokens=GREEDY_TOKENS, temperature=0)
    assert whole.choices[0].text == want[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=4, n=2)    # a choice a request
    two = client.completions.create(model=MODEL, prompt=default_prompts[3], max_tokens=6,
                                    temperature=1.0, seed=4, n=2)
    assert [c.text for c in two.choices] == [o.text for o in default_llm.generate([default_prompts[3]], params)]


def test_prompts_sharing_a_prefix_land_on_one_replica(replicas, default_llm):
    c, url, client = replicas
    shared = "You are a careful assistant. Answer briefly and precisely. " * 6
    time.sleep(1.5 * POST_EVERY_S)          # the earlier tests' requests are posted by now
    before = metric(url, "twophase_requests_finished_total")
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"{shared}Question {i}: name a colour.",
                                  max_tokens=2, temperature=0)
    after = wait_for(lambda: (m := metric(url, "twophase_requests_finished_total"))
                     and sum(m.values()) - sum(before.values()) >= 6 and m, 5, "metrics not posted")
    time.sleep(1.5 * POST_EVERY_S)
    after = metric(url, "twophase_requests_finished_total")
    served = {k: after[k] - before.get(k, 0) for k in after}
    hit = metric(url, "twophase_prefix_cache_hit_rate")
    print(f"requests per replica {served}; prefix-cache hit rate {hit}")
    assert sorted(served.values())[-1] == 6, f"the prefix was split across replicas: {served}"
    assert max(hit.values()) > 0.5


def test_a_killed_replica_errors_its_stream_and_the_other_keeps_serving(replicas, default_llm,
                                                                         default_prompts):
    import ray

    c, url, client = replicas
    stream = client.completions.create(model=MODEL, prompt=default_prompts[2], max_tokens=400,
                                       temperature=0, stream=True, extra_body={"min_tokens": 400})
    next(iter(stream))
    running = wait_for(lambda: {k: v for k, v in metric(url, "twophase_requests_running").items() if v},
                       5, "no replica reports the request running")
    [victim] = running
    actor = ray.get_actor(f"SERVE_REPLICA::{c.app_name}#twophase-engine#{victim.removeprefix('replica-')}",
                          namespace="serve")
    ray.kill(actor, no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="replica"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 10, "the error took too long"
    assert streamed(client, default_prompts[0]) == expected(default_llm, default_prompts[:1])[0]


# -- disaggregated prefill and decode -------------------------------------------------------
@pytest.fixture(scope="module")
def disaggregated(ray_cluster):
    with cluster_server(prefill_workers=1, decode_workers=1, kv_lease_s=5.0) as served:
        yield served


def all_free(c, timeout: float = 5.0) -> None:
    wait_for(lambda: all(s["used_blocks"] == 0 and s["leased_blocks"] == 0 and s["in_flight"] == 0
                         for s in c.kv_states().values()), timeout,
             f"blocks still taken: {c.kv_states()}")


def test_disaggregated_gives_one_engines_greedy_text(disaggregated, default_llm, default_prompts):
    c, url, client = disaggregated
    prompts = default_prompts[1:3]
    want = expected(default_llm, prompts)
    assert [streamed(client, p) for p in prompts] == want
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = default_llm.tokenizer.apply_chat_template(messages)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=GREEDY_TOKENS)
    assert chat.choices[0].message.content == expected(default_llm, [prompt])[0]
    # structured output: the decode worker continues the grammar from the prefill's first token
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "why": {"type": "string", "maxLength": 40}},
              "required": ["colour", "why"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, response_format=fmt)
    alone = default_llm.generate([prompt], SamplingParams(max_tokens=60, structured=StructuredOutputs(json=schema)))
    assert got.choices[0].message.content == alone[0].text and got.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "strin"}}})
    # a stop string made of the first token's last character and the second's first two
    out = default_llm.generate([prompts[0]], SamplingParams(max_tokens=GREEDY_TOKENS))[0]
    detok = IncrementalDetokenizer(default_llm.tokenizer)
    stop = detok.push(out.token_ids[0])[-1:] + detok.push(out.token_ids[1])[:2]
    want = default_llm.generate([prompts[0]], SamplingParams(max_tokens=GREEDY_TOKENS, stop=[stop]))[0].text
    assert streamed(client, prompts[0], stop=[stop]) == want
    one = client.completions.create(model=MODEL, prompt=default_prompts[0], max_tokens=1)
    assert one.choices[0].text and one.choices[0].finish_reason == "length"
    all_free(c)
    assert metric(url, "twophase_decode_tokens_total")["twophase-decode-0"] > 0


def test_clients_gone_during_the_transfer_free_both_pools(disaggregated):
    import ray

    c, url, client = disaggregated
    [prefill] = c.workers["prefill"]
    ray.get(prefill.delay_reads.remote(1.5))
    try:
        for _ in range(3):
            stream = client.completions.create(model=MODEL, prompt="Tell me about the sea. " * 8,
                                               max_tokens=50, temperature=0, stream=True)
            next(iter(stream))                   # the first token: the pull is under way
            stream.close()
        all_free(c, timeout=8)
    finally:
        ray.get(prefill.delay_reads.remote(0))


def test_a_prefill_worker_killed_mid_transfer_errors_within_2_s_and_comes_back(disaggregated):
    """The request in transfer ends with an error at once; Ray restarts the worker (its actor is
    supervised) and the next request is served. (Recomputing instead of the error,
    ``kv_load_failure = "recompute"``, is the same path: tests/core/test_kv_transfer.py.)"""
    import ray

    c, url, client = disaggregated
    [prefill] = c.workers["prefill"]
    ray.get(prefill.delay_reads.remote(30))
    stream = client.completions.create(model=MODEL, prompt="Tell me about the sea. " * 8,
                                       max_tokens=GREEDY_TOKENS, temperature=0, stream=True)
    next(iter(stream))                        # the first token: the decode worker is pulling
    ray.kill(prefill, no_restart=False)
    t0 = time.monotonic()
    # Whichever comes first under load: Ray reporting the dead peer, or the 2 s pull timeout.
    with pytest.raises(openai.APIError, match="pulling the KV blocks|did not arrive within 2 s"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 2.5, "the decode side waited too long on a dead peer"
    [decode] = c.workers["decode"]
    wait_for(lambda: ray.get(decode.kv_state.remote())["used_blocks"] == 0, 5, "decode blocks leaked")
    deadline = time.monotonic() + 90
    while True:                               # a 503 says the worker is restarting: retry, as told
        try:
            again = client.completions.create(model=MODEL, prompt="Tell me about the sea.", max_tokens=4,
                                              temperature=0, timeout=120)
            break
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and "restarting" in str(exc), exc
            assert time.monotonic() < deadline, "the prefill worker did not come back"
            time.sleep(1)
    assert again.choices[0].finish_reason == "length"
