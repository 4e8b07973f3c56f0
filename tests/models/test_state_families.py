"""Models whose cache is mostly a state (Qwen3-Next, Qwen3.5: Gated DeltaNet three layers in
four; Granite 4: Mamba-2 layers) against HF transformers on the same random weights: logits at
every position of a whole prompt and of the same prompt in chunks (the state carried from chunk
to chunk), greedy tokens as HF's ``generate``, batching with preemption, and what the engine
refuses for them yet."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_models import STATE_FAMILIES, tiny_hf_model

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.errors import ConfigError
from twophase.testing import assert_greedy_match, logprob_gaps

transformers = pytest.importorskip("transformers")

# each family's state layers as a refusal names them, and a config key that sizes their weights
# (with a value the checkpoint's weights do not have)
STATE_KIND = {"qwen3_5": "Gated DeltaNet", "qwen3_next": "Gated DeltaNet", "granitemoehybrid": "Mamba-2"}
STATE_DIM = {"qwen3_5": ("linear_num_value_heads", 8), "qwen3_next": ("linear_num_value_heads", 8),
             "granitemoehybrid": ("mamba_d_state", 32)}


@pytest.fixture(scope="module", params=STATE_FAMILIES)
def hf(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, tiny_hf_model(request.param, folder), request.param


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _llm(folder, **sections) -> LLM:
    return LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64}, **sections})


def test_logits_match_transformers_whole_and_in_chunks(hf):
    """150 tokens: more than two of the chunked form's chunks (DeltaNet's 64 tokens, the tiny
    Granite's 16), and engine chunks that start and end inside them; each chunk reads the state
    the one before it left, and one at position 0 none."""
    folder, ref, _ = hf
    llm = _llm(folder)
    ids = torch.randint(3, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]
    eng = llm.engine
    req = eng.add_request(ids[0].tolist(), SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, 150)
    whole = prefill_batch([(req, 0, 150)], eng.kv)
    whole.logits = "all"
    assert _rel(llm.prefill_backend.prefill(whole), want) < 1e-4
    # a one-token chunk: the recurrence; at position 0 over the state the whole prompt left, a
    # fresh start (a slot is reused without being cleared)
    for start, n in ((0, 1), (0, 40), (40, 1), (41, 69), (110, 40)):
        b = prefill_batch([(req, start, n)], eng.kv)
        b.logits = "all"
        assert _rel(llm.prefill_backend.prefill(b), want[start:start + n]) < 1e-4, (start, n)
    eng.abort(req.request_id)


def test_greedy_equals_transformers_generate(hf):
    folder, ref, _ = hf
    prompt = list(range(5, 25))
    out = _llm(folder).generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2))[0]
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                         pad_token_id=0)
    assert_greedy_match(out.token_ids, g[0, 20:].tolist(), logprob_gaps(out), "greedy")


def test_batched_with_preemption_and_chunks_gives_each_request_its_alone_tokens(hf):
    """Requests share steps (decodes beside prefill chunks), are preempted and recomputed from
    position 0 in another slot: each gets the tokens it gets alone, and every slot comes back."""
    folder, _, _ = hf
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 50))] for _ in range(10)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    alone_llm = _llm(folder)
    alone = [alone_llm.generate([p], params)[0] for p in prompts]
    llm = _llm(folder, cache={"num_blocks": 24, "block_size": 4},
               scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 6})
    together = llm.generate(prompts, params)
    rep = llm.report(together)
    assert rep["preemptions"] > 0 and rep["steps_by_mix"].get("mixed"), rep
    for i, (t, a) in enumerate(zip(together, alone)):
        assert_greedy_match(t.token_ids, a.token_ids, logprob_gaps(a), f"prompt {i}")
    assert llm.engine.kv.num_free_blocks == llm.num_blocks
    assert len(llm.engine.kv._free_slots) == llm.engine.kv.state_slots


def test_what_state_layers_do_not_do_yet_is_said(hf, caplog):
    folder, _, _ = hf
    with pytest.raises(ConfigError, match="roll back"):
        _llm(folder, speculative={"method": "ngram", "num_tokens": 3})
    caplog.set_level("INFO")
    llm = _llm(folder)
    assert not llm.engine.kv.prefix_caching and "prefix caching off" in caplog.text
    assert llm.loaded.layout.state is not None and llm.loaded.layout.state.bytes_per_sequence() > 0
    assert len(llm.kv_cache.states) == 3                 # three state layers, one attends


@pytest.mark.parametrize("backend", ["onnxruntime", "native"])
def test_a_backend_without_state_layers_refuses_them_by_name(hf, backend):
    from twophase.errors import TwophaseError

    folder, _, name = hf
    with pytest.raises(TwophaseError, match=STATE_KIND[name]):
        _llm(folder, backend={"name": backend})


def test_a_checkpoint_whose_state_dims_disagree_with_its_config_is_named(hf, tmp_path):
    """config.json sizes the state layers otherwise than the weights are (8 value heads where they
    hold 4, a state of 32 where they hold 16): an error naming a state layer's tensor and both
    shapes, before anything is computed."""
    import json
    import shutil

    from twophase.errors import TwophaseError

    folder, _, name = hf
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    key, value = STATE_DIM[name]
    cfg[key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TwophaseError, match=r"disagree with its config.json: .*mixer"):
        _llm(bad)
