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
    got = llm.backend.prefill(batch)
    assert _rel(got, want) < 1e-4
    # the same prompt as three chunks after cached tokens: each chunk sees its cached prefix
    for start, n in ((0, 40), (40, 70), (110, 40)):
        b = prefill_batch([(req, start, n)], eng.kv)
        b.logits = "all"
        assert _rel(llm.backend.prefill(b), want[start:start + n]) < 1e-4, (start, n)
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
