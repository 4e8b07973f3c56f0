"""The native backend (``twophase/backends/native``): its C step against an independent torch
reference, its decode path against its own prefill, batching against requests run alone, and
the default model's quality."""

from __future__ import annotations

import pytest
import torch

from conftest import PREEMPTING, random_prompts, tiny_llm
from twophase import LLM, SamplingParams
from twophase.backends.base import BackendUnavailable

Q4 = {"quantization": "q4"}


def _native_or_skip():
    from twophase.backends.native import NativeBackend

    try:
        NativeBackend.check_available("cpu")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(autouse=True)
def _needs_native():
    _native_or_skip()


def _all_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every position of ``prompts``, prefilled as one batch of chunks."""
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=2))
    sched = eng.scheduler.schedule()
    batch = eng._prefill_batch([(r, 0, n) for r, n in sched.prefills])
    batch.logits = "all"
    return llm.prefill_backend.prefill(batch)


def test_native_logits_match_the_dequantised_model():
    """Several sequences' chunks in one step; int8 activations, as onnxruntime's level 4: the
    same stated tolerance (measured: 8e-3)."""
    from test_quant import _dequantised_reference

    native = tiny_llm(model=Q4, backend={"name": "native"})
    ref = _dequantised_reference(native)
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    got, want = _all_logits(native, prompts), _all_logits(ref, prompts)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 5e-2, f"logits differ by {rel:.2e} (relative)"


def test_decode_after_prefill_equals_one_prefill_of_all_the_tokens():
    """Each row's arithmetic is its own, so a decode over K/V paged in earlier steps must give
    exactly the logits of the same token inside one long chunk: the greedy tokens' log-probs
    of a generation equal those of one prefill of the prompt and the generated tokens."""
    cache = {"num_blocks": 64, "block_size": 4}
    prompt = list(range(7, 7 + 21))
    out = tiny_llm(model=Q4, backend={"name": "native"}, cache=cache).generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))[0]
    whole = _all_logits(tiny_llm(model=Q4, backend={"name": "native"}, cache=cache),
                        [prompt + out.token_ids[:-1]])
    lp = torch.log_softmax(whole.float(), dim=-1)
    for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got == {token: float(lp[len(prompt) - 1 + i, token])}, f"token {i}"


def test_batching_chunking_and_preemption_change_no_token():
    """Under a pool and budget that preempt and split prompts into chunks, every request's greedy
    tokens equal its tokens run alone."""
    prompts = random_prompts(8)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    together = tiny_llm(model=Q4, backend={"name": "native"}, **PREEMPTING).generate(prompts, p)
    alone = tiny_llm(model=Q4, backend={"name": "native"})
    assert [o.token_ids for o in together] == [alone.generate([q], p)[0].token_ids for q in prompts]


def test_prefill_on_onnxruntime_decode_on_native():
    """The routing the backend is for: one pool, two backends; the first token is
    onnxruntime's own."""
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = random_prompts(3, seed=1)
    routed = tiny_llm(model=Q4, backend={"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}})
    assert type(routed.engine.decode_backend).__name__ == "NativeBackend"
    ort = tiny_llm(model=Q4, backend={"name": "onnxruntime"})
    got, want = routed.generate(prompts, p), ort.generate(prompts, p)
    assert [o.token_ids[0] for o in got] == [o.token_ids[0] for o in want]
    assert all(len(o.token_ids) == 6 for o in got)


def test_native_refuses_float_weights_and_bad_options():
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="native backend does not run 'none'"):
        tiny_llm(backend={"name": "native"})
    with pytest.raises(ConfigError, match="threads"):
        tiny_llm(model=Q4, backend={"name": "native", "options": {"threads": 0}})


@pytest.mark.slow
def test_default_model_quality_on_native():
    """The GGUF's blocks through the C step: perplexity within 0.5% of the float model's on the
    shipped text and mean KL under 0.005 (measured: -0.16%, 0.0034; llama.cpp: 0.0080)."""
    from twophase.quality import kl_divergence, perplexity, shipped_text

    text = shipped_text()
    cfg = {"cache": {"num_blocks": 128}}
    ref = LLM.from_config(cfg)
    native = LLM.from_config({**cfg, "model": Q4, "backend": {"name": "native"}})
    assert abs(perplexity(native, text) / perplexity(ref, text) - 1) < 0.005
    assert kl_divergence(native, ref, text) < 0.005
