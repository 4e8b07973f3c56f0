"""Every family against HF transformers: a tiny model of each built from a config with seeded
random weights, saved as an HF folder, loaded through ``model.path``; the same logits at every
position (whole prompt, and in chunks after cached tokens) and the same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import BASE, FAMILIES, tiny_hf_model

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.errors import ModelError

transformers = pytest.importorskip("transformers")

GEMMA = {"norm_offset", "post_norms", "gelu_tanh", "embed_scale", "query_scale", "sliding_window"}
PROMPT = 80           # longer than Mistral's window, so the window shows


@pytest.fixture(scope="module", params=FAMILIES)
def hf_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_model(request.param, folder)
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64, "block_size": 8}})
    return request.param, model, llm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_family_loads_as_itself(hf_model):
    name, _, llm = hf_model
    arch = llm.model.arch
    assert arch.family == name
    want = {"llama": {"qkv_bias", "o_bias"}, "qwen2": {"qkv_bias"}, "qwen3": {"qk_norm"},
            "mistral": {"sliding_window"}, "mixtral": {"moe"}, "phi3": {"partial_rotary"},
            "qwen3_moe": {"qk_norm", "moe"},
            "gemma2": GEMMA | {"attn_softcap", "final_softcap"}, "gemma3": GEMMA | {"qk_norm", "rope_per_layer"}}[name]
    assert arch.features() == want


def test_logits_match_transformers_whole_and_in_chunks(hf_model):
    _, ref, llm = hf_model
    ids = torch.randint(3, 300, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]
    eng = llm.engine
    req = eng.add_request(ids[0].tolist(), SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, PROMPT)
    batch = prefill_batch([(req, 0, PROMPT)], eng.kv)
    batch.logits = "all"
    assert _rel(llm.backend.prefill(batch), want) < 1e-4
    for start, n in ((0, 30), (30, 1), (31, 49)):      # a one-token chunk: the decode path
        b = prefill_batch([(req, start, n)], eng.kv)
        b.logits = "all"
        assert _rel(llm.backend.prefill(b), want[start:start + n]) < 1e-4, (start, n)
    eng.abort(req.request_id)


def test_greedy_tokens_equal_transformers_generate(hf_model):
    _, ref, llm = hf_model
    prompt = list(range(5, 45))
    out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                         do_sample=False, pad_token_id=0)
    assert out.token_ids == g[0, len(prompt):].tolist()


def test_an_unknown_family_names_the_ones_that_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "vocab_size": 10}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="model_type 'mamba' is not supported.*llama.*qwen3"):
        LLM.from_config({"model": {"path": str(tmp_path)}})


def test_an_unimplemented_rope_scaling_is_refused_not_ignored():
    from twophase.models.families import by_model_type

    cfg = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelError, match="RoPE scaling 'yarn' is not implemented"):
        by_model_type("llama", "here").arch_from_hf(cfg)


@pytest.mark.exhaustive          # an export a family
@pytest.mark.parametrize("backend", ["onnxruntime", "iree"])
def test_graph_backends_trace_each_family_they_claim(hf_model, backend):
    """ONNX and IREE trace the same decoder: a family whose features they claim gives torch's
    greedy tokens; one they do not is refused before any export."""
    from twophase.errors import BackendUnavailable
    from twophase.models.graph_attention import TRACED_FEATURES

    _, _, llm = hf_model
    cfg = {"model": {"path": llm.model.weights}, "cache": {"num_blocks": 64, "block_size": 8},
           "backend": {"name": backend}}
    prompt = list(range(5, 45))
    if not llm.model.arch.features() <= TRACED_FEATURES:
        with pytest.raises(BackendUnavailable, match=f"{backend}: .* not implemented"):
            LLM.from_config(cfg)
        return
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = llm.generate([prompt], params)[0].token_ids
    assert LLM.from_config(cfg).generate([prompt], params)[0].token_ids == want
