"""The conformance checks (collected by ``pytest -p twophase.testing --pyargs twophase.testing``).

Every check runs the backend under test and the torch backend on the same batch over copies of
one KV pool, on a small random-weight model, then compares logits (1e-4 relative) and the whole
pool afterwards (so K/V must land at the batch's slots and nowhere else). With
``--quantization q4`` torch runs the dequantised weights and the bounds are ``Tolerance``'s."""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.arch import FEATURES, with_feature
from twophase.contract import (
    CONTRACT_VERSION,
    MIGRATION,
    SUPPORTED_CONTRACT_VERSIONS,
    BackendConfig,
    Capabilities,
    EngineLimits,
    KVCache,
)
from twophase.testing import Tolerance, assert_greedy_match, compare_quantised, dequantised, logprob_gaps

log = logging.getLogger("twophase.testing")

BLOCK = 4
TOKENS, SEQS = 48, 8


def _reference(quantization: str = "none", **sections) -> LLM:
    """The torch reference on the tiny model (its q4 weights dequantised for ``q4``)."""
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 128, "block_size": BLOCK},
           "scheduler": {"max_num_batched_tokens": TOKENS, "max_num_seqs": SEQS}}
    cfg.update(sections)
    llm = LLM.from_config(cfg)
    if quantization == "q4" and llm.prefill_backend.name == "torch":
        dequantised(llm)
    return llm


def _backend(llm: LLM, name: str, device: str, options: dict, quantization: str = "none"):
    b = llm.registry.get(name)()
    b.load(dataclasses.replace(llm.spec, quantization=quantization),
           BackendConfig(name, device, dict(options), EngineLimits(SEQS, TOKENS, llm.max_model_len)))
    return b


def _compare(llm: LLM, under_test, run, quantization: str = "none") -> None:
    """``run(backend)`` on the reference and on the backend under test, pools copied first."""
    pool = llm.kv_cache.pool
    theirs = pool.clone().to(under_test.kv_cache_spec().device)
    want = run(llm.prefill_backend)
    under_test.bind_kv_cache(KVCache(theirs, BLOCK))
    got = run(under_test).float().cpu()
    assert got.shape == want.shape, f"logits shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    kept = under_test.read_kv_pool()              # a backend with its own pool shows it
    diff = ((theirs if kept is None else kept).cpu().float() - pool.float()).abs()
    if quantization == "none":
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel < 1e-4, f"logits differ from the torch reference by {rel:.2e} (relative)"
        bound = 1e-5
    else:
        kl, agree, rows = compare_quantised(got, want)
        log.info("int8 activations: KL %.2e, top-1 agreement %.3f over %d of %d rows", kl, agree, rows,
                 len(want))
        assert kl < Tolerance.KL and agree >= Tolerance.TOP1, (
            f"logits: mean KL {kl:.2e} from torch on the dequantised weights (bound {Tolerance.KL}), "
            f"top-1 agreement {agree:.3f} (bound {Tolerance.TOP1})")
        bound = Tolerance.KV * float(pool.abs().max())
        untouched = (pool.float() == 0).flatten(3).all(-1)            # [layers, 2, blocks]
        stray = diff.amax(dim=(3, 4, 5))[untouched]
        assert stray.numel() == 0 or float(stray.max()) == 0, \
            "the backend wrote K/V into blocks the batch does not own"
    assert float(diff.max()) < bound, (
        f"the pool differs from the reference's after the call at "
        f"{int((diff.amax(dim=(0, 1, 3, 4, 5)) > bound).sum())} blocks: K/V written at the wrong slots")


def _advance(llm: LLM, lengths, decodes: int):
    """Requests of ``lengths`` prompt tokens, stepped until each has ``decodes`` outputs."""
    eng = llm.engine
    reqs = [eng.add_request([3 + (7 * i + j) % 500 for j in range(n)],
                            SamplingParams(max_tokens=12, ignore_eos=True))
            for i, n in enumerate(lengths)]
    while any(r.num_output_tokens < decodes for r in reqs):
        eng.step()
    return reqs


def test_it_declares_a_contract_version_this_twophase_supports(backend_info):
    """The class says which plugin contract it was written for (``contract_version``), one this
    twophase supports; an older one passes with a ``DeprecationWarning``. Runs on any device: a
    backend refused at discovery (a newer version) fails here with the reason."""
    from twophase.backends.registry import declared_version

    assert backend_info.refused is None, backend_info.refused
    declared = declared_version(backend_info.cls)
    assert declared is not None, (
        f"{backend_info.name} declares no plugin contract version (taken as version 1, deprecated): "
        f"set contract_version = {CONTRACT_VERSION} on the class; see {MIGRATION}")
    assert declared in SUPPORTED_CONTRACT_VERSIONS, (declared, SUPPORTED_CONTRACT_VERSIONS)
    if declared < CONTRACT_VERSION:
        warnings.warn(f"{backend_info.name} is written for plugin contract version {declared}, "
                      f"deprecated; this twophase's is {CONTRACT_VERSION}: see {MIGRATION}",
                      DeprecationWarning, stacklevel=1)


def test_capabilities_are_declared(backend_name, backend_device, backend_options, quantization):
    llm = _reference()
    b = _backend(llm, backend_name, backend_device, backend_options, quantization)
    caps = b.capabilities()
    assert isinstance(caps, Capabilities)
    assert torch.device(backend_device).type in caps.devices
    assert torch.float32 in caps.dtypes or llm.model.dtype in caps.dtypes
    spec, a = b.kv_cache_spec(), llm.model.arch
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (a.num_layers, a.num_kv_heads, a.head_dim)
    assert torch.device(spec.device).type == torch.device(backend_device).type


def test_it_refuses_by_name_each_feature_it_does_not_claim(backend_name, backend_device, backend_options,
                                                          quantization):
    """``Capabilities.features`` names only known features; ``supports`` accepts the plain
    model and, for every feature not claimed, refuses a model using it with the feature's name
    (a backend computing a Qwen3 as a Llama without a word is the failure this prevents); a
    feature claimed on some weight formats only (``features_on``) is refused on the others by
    ``supports_weights``, naming the feature and the format, and one claimed in one phase only
    (``features_in``) by ``supports_phase`` in the other, naming the feature and the phase."""
    llm = _reference()
    b = llm.registry.get(backend_name)()
    claimed = b.capabilities().features
    assert isinstance(claimed, frozenset) and claimed <= set(FEATURES), sorted(claimed - set(FEATURES))
    assert b.supports(llm.model.arch) is None, b.supports(llm.model.arch)
    for key in sorted(set(FEATURES) - claimed):
        why = b.supports(with_feature(llm.model.arch, key))
        assert why and FEATURES[key] in why, f"{key}: supports() said {why!r}"
    # features computed on some weight formats only: refused on the others' by name and format
    for q, only in b.capabilities().features_on.items():
        assert only <= claimed, f"features_on[{q!r}] claims {sorted(only - claimed)} beyond features"
        for key in sorted(claimed - only):
            why = b.supports_weights(with_feature(llm.model.arch, key), q)
            assert why and FEATURES[key] in why and repr(q) in why, f"{key} on {q}: {why!r}"
    # features computed in one phase only (``features_in``): refused in the other by name and phase
    for phase, only in b.capabilities().features_in.items():
        assert phase in ("prefill", "decode") and only <= claimed, (phase, sorted(only - claimed))
        for key in sorted(claimed - only):
            why = b.supports_phase(with_feature(llm.model.arch, key), "none", phase)
            assert why and FEATURES[key] in why and f"in {phase}" in why, f"{key} in {phase}: {why!r}"


@pytest.mark.parametrize("logits", ["last", "all"])
def test_prefill_of_fresh_prompts_of_unequal_lengths(backend_name, backend_device, backend_options,
                                                    quantization, logits):
    llm = _reference(quantization)
    for i, n in enumerate((9, 30, 3)):
        llm.engine.add_request([3 + (5 * i + j) % 500 for j in range(n)], SamplingParams(max_tokens=4))
    _, batch = llm.engine.schedule_batch("prefill")
    batch.logits = logits
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options, quantization),
             lambda b: b.prefill(batch), quantization)


def test_chunked_prefill_after_cached_tokens(backend_name, backend_device, backend_options, quantization):
    llm = _reference(quantization)
    _advance(llm, (21,), 1)
    req = llm.engine.add_request([3 + (7 * 0 + j) % 500 for j in range(21)] + list(range(200, 230)),
                                 SamplingParams(max_tokens=3))
    sched, batch = llm.engine.schedule_batch("prefill")
    items = [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
    assert any(r is req and s > 0 for r, s, _ in items), "expected a prefix-cache hit"
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options, quantization),
             lambda b: b.prefill(batch), quantization)


def test_decode_of_sequences_of_unequal_lengths(backend_name, backend_device, backend_options, quantization):
    llm = _reference(quantization)
    reqs = _advance(llm, (5, 17, 33, 2), 2)
    sched, batch = llm.engine.schedule_batch("decode")
    assert not sched.prefills and len({r.num_computed_tokens for r in sched.decodes}) > 1
    assert len(sched.decodes) == len(reqs)
    _compare(llm, _backend(llm, backend_name, backend_device, backend_options, quantization),
             lambda b: b.decode(batch), quantization)


def test_mixed_batch_of_chunks_and_decodes(backend_name, backend_device, backend_options, quantization):
    llm = _reference(quantization)
    b = _backend(llm, backend_name, backend_device, backend_options, quantization)
    if not b.capabilities().mixed_batches:
        pytest.skip("the backend declares no mixed batches")
    _advance(llm, (6, 25), 1)
    llm.engine.add_request(list(range(40, 80)), SamplingParams(max_tokens=3))
    sched, batch = llm.engine.schedule_batch("mixed")
    assert sched.decodes and sched.prefills
    _compare(llm, b, lambda x: x.prefill(batch), quantization)


def test_adapters_per_sequence_in_one_batch(backend_name, backend_device, backend_options, quantization,
                                            tmp_path):
    """A backend that claims adapters (``Capabilities.adapters``) applies each sequence's own
    in one mixed batch, as torch does; one that does not is refused by the engine by name."""
    llm = _reference(quantization)
    b = _backend(llm, backend_name, backend_device, backend_options, quantization)
    if not b.capabilities().adapters:
        pytest.skip("the backend does not claim adapters (the engine refuses [[lora]] with it by name)")
    from twophase.lora.peft_adapter import load_peft_adapter
    from twophase.lora.random_adapter import write_random_adapter
    from twophase.models.families import FAMILIES

    names = FAMILIES[llm.model.arch.family].layer_names
    model = llm.prefill_backend.model
    for slot in (0, 1):
        folder = write_random_adapter(model, names, tmp_path / f"a{slot}", rank=4, seed=slot, std=0.2)
        adapter = load_peft_adapter(f"a{slot}", folder, model, names)
        llm.prefill_backend.place_adapter(slot, adapter)
        b.place_adapter(slot, adapter)
    _advance(llm, (6, 25), 1)
    llm.engine.add_request(list(range(40, 80)), SamplingParams(max_tokens=3))
    sched, batch = llm.engine.schedule_batch("mixed")
    batch.lora_slots = [i % 3 - 1 for i in range(batch.num_seqs)]      # base, a0, a1, base, ...
    _compare(llm, b, lambda x: x.prefill(batch), quantization)


def test_generate_with_chunking_and_preemption_equals_torch(backend_name, backend_device,
                                                           backend_options, quantization):
    """Tokens through chunked prefill and preemption equal torch's (q4: the backend's own on a
    pool that never preempts: its rows must not depend on how the steps were cut)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    under_test = {"name": backend_name, "device": backend_device, "options": backend_options}
    q4 = {"model": {"name": "tiny", "weights": "random", "dtype": "float32", "quantization": quantization}}
    small = {"cache": {"num_blocks": 48, "block_size": BLOCK}}
    ref = _reference(**small) if quantization == "none" else _reference(**q4, backend=under_test,
                                                                        scheduler={"max_num_seqs": SEQS})
    llm = _reference(**small, **(q4 if quantization != "none" else {}), backend=under_test)
    outs = llm.generate(prompts, p)
    assert llm.report(outs)["preemptions"] > 0, "the workload was meant to preempt"
    want = ref.generate(prompts, p)
    if quantization != "none":
        assert ref.report(want)["preemptions"] == 0, "the backend's own run was meant not to preempt"
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.engine.stats().free_blocks == llm.num_blocks, "blocks leaked"


def test_greedy_tokens_on_the_default_model(backend_name, backend_device, backend_options, quantization,
                                            request):
    if request.config.getoption("--skip-default-model", default=False):
        pytest.skip("--skip-default-model")
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    p = SamplingParams(max_tokens=16, logprobs=2)
    ref = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 64}})
    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct", "quantization": quantization},
                           "cache": {"num_blocks": 64},
                           "backend": {"name": backend_name, "device": backend_device,
                                       "options": backend_options}})
    if quantization != "none":
        from twophase.measure import quality

        kl = quality.kl_divergence(llm, ref, quality.shipped_text()[:2000])
        agree = quality.greedy_agreement(llm, ref, prompts, max_tokens=16)
        log.info("the default model on q4: KL %.4f from float32, greedy agreement %.3f", kl, agree)
        assert kl < Tolerance.MODEL_KL and agree >= Tolerance.MODEL_AGREE, (
            f"KL {kl:.4f} from the float32 model (bound {Tolerance.MODEL_KL}), greedy agreement "
            f"{agree:.3f} (bound {Tolerance.MODEL_AGREE})")
        return
    for i, (want, got) in enumerate(zip(ref.generate(prompts, p), llm.generate(prompts, p))):
        assert_greedy_match(got.token_ids, want.token_ids, logprob_gaps(want), f"prompt {i}")
