"""The conformance checks (collected by ``pytest -p twophase.testing --pyargs twophase.testing``).

Every check runs the backend under test and the torch backend on the same batch over copies of
one KV pool, on a small random-weight model, then compares logits (1e-4 relative) and the whole
pool afterwards (so K/V must land at the batch's slots and nowhere else)."""

from __future__ import annotations

import random

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.backends.base import (
    BackendConfig,
    Capabilities,
    EngineLimits,
    KVCache,
)
from twophase.core.batch import decode_batch, prefill_batch
from twophase.testing import assert_greedy_match, logprob_gaps

BLOCK = 4
TOKENS, SEQS = 48, 8


def _reference(**sections) -> LLM:
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 128, "block_size": BLOCK},
           "scheduler": {"max_num_batched_tokens": TOKENS, "max_num_seqs": SEQS}}
    cfg.update(sections)
    return LLM.from_config(cfg)


def _backend(llm: LLM, name: str, device: str, options: dict):
    b = llm.registry.get(name)()
    b.load(llm.spec,
           BackendConfig(name, device, dict(options), EngineLimits(SEQS, TOKENS, llm.max_model_len)))
    return b


def _compare(llm: LLM, under_test, run) -> None:
    """``run(backend)`` on the reference and on the backend under test, pools copied first."""
    pool = llm.kv_cache.pool
    theirs = pool.clone().to(under_test.kv_cache_spec().device)
    want = run(llm.backend)
    under_test.bind_kv_cache(KVCache(theirs, BLOCK))
    got = run(under_test).float().cpu()
    assert got.shape == want.shape, f"logits shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-4, f"logits differ from the torch reference by {rel:.2e} (relative)"
    kept = under_test.read_kv_pool()              # a backend with its own pool shows it
    diff = ((theirs if kept is None else kept).cpu().float() - pool.float()).abs()
    assert float(diff.max()) < 1e-5, (
        f"the pool differs from the reference's after the call at "
        f"{int((diff.amax(dim=(0, 1, 3, 4, 5)) > 1e-5).sum())} blocks: K/V written at the wrong slots")


def _advance(llm: LLM, lengths, decodes: int):
    """Requests of ``lengths`` prompt tokens, stepped until each has ``decodes`` outputs."""
    eng = llm.engine
    reqs = [eng.add_request([3 + (7 * i + j) % 500 for j in range(n)],
                            SamplingParams(max_tokens=12, ignore_eos=True))
            for i, n in enumerate(lengths)]
    while any(r.num_output_tokens < decodes for r in reqs):
        eng.step()
    return reqs


def test_capabilities_are_declared(backend_name, backend_device, backend_options):
    llm = _reference()
    b = _backend(llm, backend_name, backend_device, backend_options)
    caps = b.capabilities()
    assert isinstance(caps, Capabilities)
    assert torch.device(backend_device).type in caps.devices
    assert torch.float32 in caps.dtypes or llm.model.dtype in caps.dtypes
    spec, a = b.kv_cache_spec(), llm.model.arch
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (a.num_layers, a.num_kv_heads, a.head_dim)
    assert torch.device(spec.device).type == torch.device(backend_device).type


@pytest.mark.parametrize("logits", ["last", "all"])
def test_prefill_of_fresh_prompts_of_unequal_lengths(backend_name, backend_device, backend_options,
                                                    logits):
    llm = _reference()
    for i, n in enumerate((9, 30, 3)):
        llm.engine.add_request([3 + (5 * i + j) % 500 for j in range(n)], SamplingParams(max_tokens=4))
    sched = llm.engine.scheduler.schedule()
    batch = prefill_batch([(r, 0, n) for r, n in sched.prefills], llm.engine.kv)
    batch.logits = logits
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options), lambda b: b.prefill(batch))


def test_chunked_prefill_after_cached_tokens(backend_name, backend_device, backend_options):
    llm = _reference()
    _advance(llm, (21,), 1)
    req = llm.engine.add_request([3 + (7 * 0 + j) % 500 for j in range(21)] + list(range(200, 230)),
                                 SamplingParams(max_tokens=3))
    sched = llm.engine.scheduler.schedule()
    items = [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
    assert any(r is req and s > 0 for r, s, _ in items), "expected a prefix-cache hit"
    batch = prefill_batch(items, llm.engine.kv)
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options), lambda b: b.prefill(batch))


def test_decode_of_sequences_of_unequal_lengths(backend_name, backend_device, backend_options):
    llm = _reference()
    reqs = _advance(llm, (5, 17, 33, 2), 2)
    sched = llm.engine.scheduler.schedule()
    assert not sched.prefills and len({r.num_computed_tokens for r in sched.decodes}) > 1
    batch = decode_batch(sched.decodes, llm.engine.kv)
    assert len(sched.decodes) == len(reqs)
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options), lambda b: b.decode(batch))


def test_mixed_batch_of_chunks_and_decodes(backend_name, backend_device, backend_options):
    llm = _reference()
    b = _backend(llm, backend_name, backend_device, backend_options)
    if not b.capabilities().mixed_batches:
        pytest.skip("the backend declares no mixed batches")
    _advance(llm, (6, 25), 1)
    llm.engine.add_request(list(range(40, 80)), SamplingParams(max_tokens=3))
    sched = llm.engine.scheduler.schedule()
    assert sched.decodes and sched.prefills
    items = [(r, r.num_computed_tokens, 1) for r in sched.decodes] + \
            [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
    batch = prefill_batch(items, llm.engine.kv)
    _compare(llm, b, lambda x: x.prefill(batch))


def test_generate_with_chunking_and_preemption_equals_torch(backend_name, backend_device,
                                                           backend_options):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    small = {"cache": {"num_blocks": 48, "block_size": BLOCK}}
    ref = _reference(**small)
    llm = _reference(**small, backend={"name": backend_name, "device": backend_device,
                                       "options": backend_options})
    outs = llm.generate(prompts, p)
    assert llm.report(outs)["preemptions"] > 0, "the workload was meant to preempt"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, p)]
    assert llm.engine.kv.num_free_blocks == llm.num_blocks, "blocks leaked"


def test_greedy_tokens_on_the_default_model(backend_name, backend_device, backend_options, request):
    if request.config.getoption("--skip-default-model", default=False):
        pytest.skip("--skip-default-model")
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    p = SamplingParams(max_tokens=16, logprobs=2)
    ref = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 64}})
    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 64},
                           "backend": {"name": backend_name, "device": backend_device,
                                       "options": backend_options}})
    for i, (want, got) in enumerate(zip(ref.generate(prompts, p), llm.generate(prompts, p))):
        assert_greedy_match(got.token_ids, want.token_ids, logprob_gaps(want), f"prompt {i}")
