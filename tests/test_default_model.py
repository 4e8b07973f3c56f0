"""The default model against an independent reference: HF transformers loading the same GGUF
with its own loader (so a conversion error on our side cannot hide)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import GREEDY_TOKENS, top2_gaps

from twophase import SamplingParams
from twophase.core.batch import prefill_batch
from twophase.models import hub
from twophase.testing import assert_greedy_match

pytestmark = pytest.mark.slow
REF_TOKENS = 48


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    gguf = hub.gguf_path(hub.DEFAULT_MODEL)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def hf_greedy(hf, default_prompts):
    """Reference greedy tokens and the top-2 logit gap at each step, per prompt."""
    tok, model = hf
    out = []
    for prompt in default_prompts:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=REF_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        tokens = g.sequences[0, ids.shape[1]:].tolist()
        gaps = [top2_gaps(s[0]) for s in g.logits]
        out.append((ids[0].tolist(), tokens, gaps))
    return out


def test_tokenizer_and_chat_template_match_hf(hf, default_llm):
    tok, _ = hf
    messages = [{"role": "user", "content": "Hello there, how are you? 123 ½"}]
    ours = default_llm.tokenizer.apply_chat_template(messages)
    assert ours == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert default_llm.tokenizer.encode(ours) == tok(ours, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def ours_alone(default_llm, default_prompts):
    """Each prompt run on its own (the reference for batched runs too)."""
    params = SamplingParams(max_tokens=REF_TOKENS)
    return [default_llm.generate([p], params)[0] for p in default_prompts]


def test_greedy_tokens_equal_hf(default_prompts, ours_alone, hf_greedy):
    for prompt, o, (ref_prompt, ref, gaps) in zip(default_prompts, ours_alone, hf_greedy):
        assert o.prompt_token_ids == ref_prompt
        ref_cut = ref[:-1] if ref and ref[-1] == 2 else ref     # HF keeps the EOS token
        ours = [t for t in o.token_ids if t != 2]
        assert_greedy_match(ours, ref_cut, gaps, repr(prompt[-30:]))


def test_prompt_logits_close_to_hf(hf, default_llm, default_prompts):
    """Last-token logits of a prompt within 1e-4 of the reference, relative to max |ref|."""
    _, model = hf
    prompt = default_llm.tokenizer.encode(default_prompts[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]

    eng = default_llm.engine
    req = eng.add_request(prompt, SamplingParams(max_tokens=1))
    sched = eng.scheduler.schedule()
    (r, n), = sched.prefills
    logits = default_llm.prefill_backend.prefill(prefill_batch([(r, r.num_computed_tokens, n)], eng.kv))[0]
    eng.abort(req.request_id)
    err = (logits - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, f"relative logit error {err:.2e}"


def test_batched_chunked_and_prefix_cached_runs_give_the_same_tokens(default_llm, default_prompts,
                                                                    ours_alone, hf_greedy):
    """All prompts together, chunked by a small budget, then again with prefix-cache hits."""
    params = SamplingParams(max_tokens=GREEDY_TOKENS)
    alone = [o.token_ids[:GREEDY_TOKENS] for o in ours_alone]
    sched = default_llm.engine.scheduler
    old_budget, sched.budget = sched.budget, 80
    try:
        together = default_llm.generate(default_prompts, params)
        again = default_llm.generate(default_prompts, params)
    finally:
        sched.budget = old_budget
    for i, (t, a, (_, _, gaps)) in enumerate(zip(together, again, hf_greedy)):
        assert_greedy_match(t.token_ids, alone[i], gaps, f"prompt {i} batched and chunked")
        assert_greedy_match(a.token_ids, alone[i], gaps, f"prompt {i} with prefix-cache hits")
    long = [o for o in again if len(o.prompt_token_ids) > 16]     # at least one full block
    assert long and all(o.metrics["num_cached_tokens"] >= 16 for o in long)


def test_stop_string_cuts_the_text(default_llm, default_prompts):
    free = default_llm.generate([default_prompts[2]], SamplingParams(max_tokens=GREEDY_TOKENS))[0]
    words = free.text.split()
    stop = words[len(words) // 2]
    out = default_llm.generate([default_prompts[2]],
                               SamplingParams(max_tokens=GREEDY_TOKENS, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]


def test_streamed_text_equals_final_text_with_stop_strings(default_llm, default_prompts):
    """Text held back for a possible stop string is never streamed and then taken back."""
    free = default_llm.generate([default_prompts[3]], SamplingParams(max_tokens=GREEDY_TOKENS))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    eng = default_llm.engine
    req = eng.add_request(default_prompts[3], SamplingParams(max_tokens=GREEDY_TOKENS, stop=[stop, "zzzz"]))
    streamed, mine = [], []
    while not req.finished:
        mine += [d for d in eng.step() if d.request_id == req.request_id]
    streamed = [d.text for d in mine]
    final = mine[-1].output
    assert "".join(streamed) == final.text == free.text[:free.text.index(stop)]
    assert req.finish_reason == final.finish_reason == "stop"


def _check_prompt_logprobs(out, prompt: list[int], ref: torch.Tensor, k: int, what: str) -> None:
    """Each prompt token's log-probability and its top ``k`` within 1e-4 of ``ref`` (HF's
    log_softmax at the position before it); the first token has none."""
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None, what
    for p in range(1, len(prompt)):
        got, row = lps[p], ref[p - 1]
        assert abs(got[prompt[p]] - row[prompt[p]].item()) < 1e-4, f"{what}: position {p}"
        top = row.topk(k)
        for i, v in zip(top.indices.tolist(), top.values.tolist()):
            assert i in got and abs(got[i] - v) < 1e-4, f"{what}: position {p}, top {i}"


def test_prompt_logprobs_equal_hf_whole_chunked_and_on_a_prefix_hit(hf, default_llm, default_prompts):
    """The prompt's log-probabilities are computed in the prefill that runs anyway: whole,
    split into chunks, and again on a prompt whose blocks are cached (the hit is not taken)."""
    _, model = hf
    prompt = default_llm.tokenizer.encode(" ".join(default_prompts))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    sched = default_llm.engine.scheduler
    whole = default_llm.generate([prompt], params)[0]
    old_budget, sched.budget = sched.budget, 40
    try:
        chunked = default_llm.generate([prompt], params)[0]
    finally:
        sched.budget = old_budget
    plain = default_llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert len(prompt) > 2 * 40
    for out, what in [(whole, "whole"), (chunked, "chunked, its blocks cached by the first")]:
        _check_prompt_logprobs(out, prompt, ref, 3, what)
    assert chunked.metrics["num_cached_tokens"] == 0
    assert plain.prompt_logprobs is None and plain.metrics["num_cached_tokens"] > 0
    assert whole.token_ids == chunked.token_ids == plain.token_ids
