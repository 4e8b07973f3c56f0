"""Embeddings (``core/pooling.py``): pooled final hidden states, computed as prefill-only work
through the scheduler, against HF transformers' hidden states pooled the same way and against
sentence-transformers for a folder with its pooling config."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers.hf_models import hf_config, hf_pooled, tiny_hf_model
from helpers.models import tiny_llm

from twophase import LLM, PoolingParams, SamplingParams
from twophase.core.pooling import PoolingConfig
from twophase.errors import RequestRejected

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris, a city on the Seine with many old bridges and museums. "
         "Its river divides it into a northern Right Bank and a southern Left Bank, joined by thirty-"
         "seven bridges, the oldest of which, the Pont Neuf, was finished in 1607.",
         "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "Hi"]
ATOL = 1e-4
CASES = [(p, n) for p in ("last", "mean", "cls") for n in (False, True)]


reference = hf_pooled


def ours(llm: LLM, prompts, pooling: str, normalize: bool) -> list[torch.Tensor]:
    outs = llm.embed(prompts, PoolingParams(pooling, normalize))
    assert all(o.finish_reason == "stop" and o.token_ids == [] for o in outs), outs
    return [torch.tensor(o.embedding) for o in outs]


def every_case(llm: LLM, prompts) -> dict[tuple[str, bool], list[torch.Tensor]]:
    """Each prompt's embedding in every case of ``CASES``, all queued at once (one engine run)."""
    eng = llm.engine
    reqs = {c: [eng.add_request(p, pooling=PoolingParams(*c)).request_id for p in prompts] for c in CASES}
    done = {}
    while eng.has_unfinished():
        done.update({d.request_id: d.output for d in eng.step() if d.output is not None})
    assert all(o.finish_reason == "stop" and o.token_ids == [] for o in done.values())
    return {c: [torch.tensor(done[r].embedding) for r in ids] for c, ids in reqs.items()}


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).abs().max().item() < ATOL, (g - w).abs().max().item()


@pytest.fixture(scope="module")
def hf_default(default_hf_base):
    return default_hf_base


@pytest.fixture(scope="module")
def token_ids(default_llm) -> list[list[int]]:
    return [default_llm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def refs(hf_default, token_ids) -> dict[tuple[str, bool], list[torch.Tensor]]:
    """HF's pooled vectors of ``TEXTS`` in every case."""
    return {c: [reference(hf_default, ids, *c) for ids in token_ids] for c in CASES}


@pytest.fixture
def chunked(default_llm):
    """The default model with a budget of 16 tokens a step: the long inputs take several chunks."""
    before = default_llm.config.scheduler
    default_llm.reschedule(dataclasses.replace(before, max_num_batched_tokens=16, max_num_seqs=4))
    yield default_llm
    default_llm.reschedule(before)


def test_default_model_matches_transformers(default_llm, refs):
    got = every_case(default_llm, TEXTS)
    for case in CASES:
        assert_close(got[case], refs[case])
    assert_close(ours(default_llm, TEXTS, "mean", True), refs["mean", True])     # LLM.embed
    assert default_llm.engine.kv.num_free_blocks == default_llm.num_blocks


def test_chunked_prefill_gives_the_same_embedding(chunked, refs, token_ids):
    assert max(map(len, token_ids)) > 3 * 16
    got = every_case(chunked, token_ids)
    for case in CASES:
        assert_close(got[case], refs[case])
    records = chunked.engine.step_records()
    assert max(r.prefill_tokens for r in records) <= 16
    assert chunked.engine.kv.num_free_blocks == chunked.num_blocks


@pytest.mark.exhaustive
def test_embeddings_beside_generation_share_steps(chunked, hf_default, token_ids):
    """Generating requests and embeddings in the same steps: each gets what it gets alone, and
    a mean embedding of a prompt already in the prefix cache computes every position again."""
    eng = chunked.engine
    alone = chunked.generate(TEXTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    gen = [eng.add_request(t, SamplingParams(max_tokens=6, ignore_eos=True)) for t in TEXTS[:2]]
    emb = {p: eng.add_request(token_ids[0], pooling=PoolingParams(p)) for p in ("mean", "last", "cls")}
    split, shared = eng.pooler.split, []

    def spy(out):
        sampled, pooled = split(out)
        shared.append(bool(sampled.scheduled) and bool(pooled))
        return sampled, pooled

    eng.pooler.split = spy
    done = {}
    while eng.has_unfinished():
        for d in eng.step():
            if d.output is not None:
                done[d.request_id] = d.output
    assert any(shared)
    assert [done[r.request_id].token_ids for r in gen] == [o.token_ids for o in alone]
    for p, req in emb.items():
        assert_close([torch.tensor(done[req.request_id].embedding)],
                     [reference(hf_default, token_ids[0], p, False)])
    assert emb["mean"].num_cached_tokens == 0 and emb["cls"].num_cached_tokens == 0
    assert emb["last"].num_cached_tokens > 0           # its last token is computed all the same
    assert eng.kv.num_free_blocks == chunked.num_blocks


def test_an_embedding_survives_preemption():
    """Mean pooling sums over chunks: a preempted request starts its sum again."""
    llm = tiny_llm(cache={"num_blocks": 16, "block_size": 4},
                   scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4})
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(3)]
    want = [o.embedding for o in llm.embed(prompts[:1], PoolingParams("mean"))]
    for p in prompts:
        llm.engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    req = llm.engine.add_request(prompts[0], pooling=PoolingParams("mean"))
    got = None
    while llm.engine.has_unfinished():
        for d in llm.engine.step():
            if d.request_id == req.request_id and d.output is not None:
                got = d.output.embedding
    assert llm.engine.scheduler.num_preemptions > 0
    assert_close([torch.tensor(got)], [torch.tensor(want[0])])
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_a_random_model_of_another_family_matches_transformers(tmp_path, family):
    ref = tiny_hf_model(family, tmp_path)
    llm = LLM.from_config({"model": {"path": str(tmp_path)}, "cache": {"num_blocks": 64, "block_size": 8},
                           "scheduler": {"max_num_batched_tokens": 24, "max_num_seqs": 4}})
    prompts = [[(11 * i + 5 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((70, 9, 1))]
    for pooling, normalize in CASES:
        assert_close(ours(llm, prompts, pooling, normalize),
                     [reference(ref.model, p, pooling, normalize) for p in prompts])
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def sentence_transformer_folder(tmp_path, default_llm, pooling_mode: str):
    """A tiny random Qwen3 with the default model's tokenizer, wrapped as sentence-transformers
    wraps an embedding model (Transformer, Pooling, Normalize) and saved: a base model's
    checkpoint (no ``model.`` prefix, no lm_head) with the modules' files beside it."""
    st = pytest.importorskip("sentence_transformers", minversion="6")
    import transformers
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    cfg = hf_config("qwen3")
    cfg.vocab_size = default_llm.model.arch.vocab_size
    cfg.tie_word_embeddings = True          # as Qwen3-Embedding: its base model holds no lm_head
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_llm.model.weights}/{name}", hf / name)
    word = Transformer(str(hf))
    pool = Pooling(word.get_embedding_dimension(), pooling_mode=pooling_mode)
    encoder = st.SentenceTransformer(modules=[word, pool, Normalize()], device="cpu")
    folder = tmp_path / "st"
    encoder.save(str(folder))
    return encoder, folder


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_a_sentence_transformers_folder_pools_as_it_says(tmp_path, default_llm, mode):
    encoder, folder = sentence_transformer_folder(tmp_path, default_llm, mode)
    assert PoolingConfig.read(folder) == PoolingConfig({"lasttoken": "last", "mean": "mean"}[mode], True)
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 64, "block_size": 8},
                           "scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4}})
    ids = [encoder.preprocess([t])["input_ids"][0].tolist() for t in TEXTS]
    want = [torch.tensor(v) for v in encoder.encode(TEXTS, convert_to_numpy=True)]
    assert_close([torch.tensor(o.embedding) for o in llm.embed(ids)], want)     # pooling "model"
    if [llm.tokenizer.encode(t) for t in TEXTS] == ids:                          # the text path too
        assert_close([torch.tensor(o.embedding) for o in llm.embed(TEXTS)], want)
    assert all(abs(float(torch.tensor(o.embedding).norm()) - 1) < 1e-5 for o in llm.embed(ids))


def test_pooling_config_needs_sentence_transformers_files(tmp_path):
    assert PoolingConfig.read(tmp_path) is None
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert PoolingConfig.read(tmp_path) == PoolingConfig("cls", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert PoolingConfig.read(tmp_path) == PoolingConfig("last", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    assert PoolingConfig.read(tmp_path).unsupported == "max"


def test_a_pooling_the_model_needs_but_is_not_computed_here_is_refused(tmp_path):
    """A folder that pools by max: ``model`` pooling is refused naming ``pooling``, never
    answered with another pooling; an explicit one is served."""
    ref = tiny_hf_model("qwen2", tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    llm = LLM.from_config({"model": {"path": str(tmp_path)}, "cache": {"num_blocks": 16, "block_size": 8}})
    with pytest.raises(RequestRejected, match="pools 'max'") as info:
        llm.engine.add_request([5, 6, 7], pooling=PoolingParams())
    assert info.value.param == "pooling" and not llm.engine.has_unfinished()
    assert_close(ours(llm, [[5, 6, 7]], "mean", False), [reference(ref.model, [5, 6, 7], "mean", False)])


def test_model_pooling_without_a_config_is_the_last_token_unnormalised(default_llm):
    assert default_llm.engine.pooler.model is None
    [a] = default_llm.embed("Hello there")
    [b] = default_llm.embed("Hello there", PoolingParams("last", False))
    assert a.embedding == b.embedding


def test_bad_inputs_are_refused_naming_input(default_llm):
    eng = default_llm.engine
    for bad, why in (([], "empty"), ([1, 10**9], "outside the vocabulary"),
                     ([5] * (eng.max_model_len + 1), "exceeds the model's context")):
        with pytest.raises(RequestRejected, match=why) as info:
            eng.add_request(bad, pooling=PoolingParams())
        assert info.value.param == "input"
    assert not eng.has_unfinished()


def test_a_backend_without_hidden_states_is_refused_by_name(monkeypatch):
    llm = tiny_llm()
    caps = llm.prefill_backend.capabilities()
    monkeypatch.setattr(llm.prefill_backend, "capabilities",
                        lambda: dataclasses.replace(caps, hidden_states=False))
    with pytest.raises(RequestRejected, match="the torch backend does not return hidden states"):
        llm.engine.add_request([5, 6, 7], pooling=PoolingParams("mean"))
    assert not llm.engine.has_unfinished()
