"""Qwen3.5's published checkpoints are its multimodal form (``Qwen3_5ForConditionalGeneration``,
model_type ``qwen3_5``: the text model's config under ``text_config``, its weights under
``model.language_model.``): the folder loads as its text model, the vision tower left out, and
on text it gives the logits and the greedy tokens of transformers' multimodal model."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.hf_models import tiny_qwen3_5_multimodal

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.models.state_dict import float_weights
from twophase.testing import assert_greedy_match, logprob_gaps

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_multimodal")
    return folder, tiny_qwen3_5_multimodal(folder, tie=request.param), request.param


def _llm(folder) -> LLM:
    return LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64}})


def test_the_folder_loads_as_its_text_model_and_says_the_images_part_is_not_loaded(hf, caplog):
    folder, ref, tie = hf
    with caplog.at_level(logging.INFO, logger="twophase.models.state_dict"):
        llm = _llm(folder)
    arch = llm.model.arch
    assert arch.family == "qwen3_5" and arch.tie_word_embeddings == tie
    assert sum(s.mixer is not None for s in arch.layers) == 3
    said = [r.getMessage() for r in caplog.records if "images part" in r.getMessage()]
    assert len(said) == 1 and "model.visual" in said[0], said
    # the exporters' reading of the same folder: the text model's tensors, by the same renaming
    text = ref.model.language_model
    w = float_weights(llm.model, lambda k: k in ("norm.weight", "layers.0.mixer.A_log"))
    assert torch.equal(w["norm.weight"], text.norm.weight)
    assert torch.equal(w["layers.0.mixer.A_log"], text.layers[0].linear_attn.A_log)


def test_logits_match_transformers_multimodal_model_on_text(hf):
    folder, ref, _ = hf
    llm = _llm(folder)
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits[0]
    eng = llm.engine
    req = eng.add_request(ids[0].tolist(), SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, 150)
    batch = prefill_batch([(req, 0, 150)], eng.kv)
    batch.logits = "all"
    got = llm.prefill_backend.prefill(batch)
    rel = (got - want).abs().amax(-1) / want.abs().amax(-1)      # at each position
    assert float(rel.max()) < 1e-4, rel
    eng.abort(req.request_id)


def test_greedy_equals_transformers_multimodal_generate(hf):
    folder, ref, _ = hf
    prompt = list(range(5, 25))
    out = _llm(folder).generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2))[0]
    with torch.no_grad():
        g = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, pad_token_id=0)
    assert_greedy_match(out.token_ids, g[0, 20:].tolist(), logprob_gaps(out), "greedy")
