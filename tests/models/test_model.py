"""Our Llama against HF's ``LlamaForCausalLM`` on the same random weights (an HF folder we
write), including Llama-3 RoPE scaling, GQA, untied head and chunks after cached tokens."""

from __future__ import annotations

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=5000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                     # larger weights: sharper logits, fewer near-ties
        for p in model.parameters():
            p.mul_(5.0) if p.dim() > 1 else None
    folder = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(folder)
    return folder, model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_hf_folder_logits_match_transformers(hf_folder):
    folder, ref = hf_folder
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64}})
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]
    # whole prompt, all positions
    eng = llm.engine
    req = eng.add_request(ids[0].tolist(), SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, 150)
    batch = prefill_batch([(req, 0, 150)], eng.kv)
    batch.logits = "all"
    got = llm.prefill_backend.prefill(batch)
    assert _rel(got, want) < 1e-4
    # the same prompt as three chunks after cached tokens: each chunk sees its cached prefix
    for start, n in ((0, 40), (40, 70), (110, 40)):
        b = prefill_batch([(req, start, n)], eng.kv)
        b.logits = "all"
        assert _rel(llm.prefill_backend.prefill(b), want[start:start + n]) < 1e-4, (start, n)
    eng.abort(req.request_id)


def test_hf_folder_greedy_equals_transformers_generate(hf_folder):
    folder, ref = hf_folder
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64}})
    prompt = list(range(5, 25))
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, pad_token_id=0)
    assert out.token_ids == g[0, 20:].tolist()


def test_the_contracts_state_dict_is_hfs_for_a_folder_and_for_random_weights(hf_folder):
    """What ``ModelSpec.state_dict()`` hands a plugin: HF's own tensors for an HF folder, and for
    random weights tensors an HF model loads strictly and then computes the torch backend's
    logits from (the numbers the reference draws, under HF's names)."""
    folder, ref = hf_folder
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64}})
    got = llm.spec.state_dict()
    want = {k: v for k, v in ref.state_dict().items() if "rotary" not in k}
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k].float()) for k in want)

    rnd = LLM.from_config({"model": {"name": "tiny", "weights": "random"}, "cache": {"num_blocks": 64}})
    a = rnd.model.arch
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rope_theta=a.rope_theta,
        rms_norm_eps=a.rms_norm_eps, max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(rnd.spec.state_dict(), strict=not a.tie_word_embeddings)
    ids = list(range(5, 45))
    req = rnd.engine.add_request(ids, SamplingParams(max_tokens=1))
    assert rnd.engine.kv.allocate(req, len(ids))
    batch = prefill_batch([(req, 0, len(ids))], rnd.engine.kv)
    batch.logits = "all"
    with torch.no_grad():
        assert _rel(rnd.prefill_backend.prefill(batch), hf(torch.tensor([ids])).logits[0]) < 1e-4
    rnd.engine.abort(req.request_id)
