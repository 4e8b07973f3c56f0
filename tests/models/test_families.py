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
DEEPSEEK = {"mla", "partial_rotary", "moe", "moe_routing"}
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
            "deepseek_v2": DEEPSEEK, "deepseek_v3": DEEPSEEK,
            "gpt_oss": {"qkv_bias", "o_bias", "attn_sinks", "moe", "moe_bias", "clamped_swiglu", "sliding_window",
                        "rope_yarn"},
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
    assert _rel(llm.prefill_backend.prefill(batch), want) < 1e-4
    for start, n in ((0, 30), (30, 1), (31, 49)):      # a one-token chunk: the decode path
        b = prefill_batch([(req, start, n)], eng.kv)
        b.logits = "all"
        assert _rel(llm.prefill_backend.prefill(b), want[start:start + n]) < 1e-4, (start, n)
    eng.abort(req.request_id)


def test_greedy_tokens_equal_transformers_generate(hf_model):
    _, ref, llm = hf_model
    prompt = list(range(5, 45))
    out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                         do_sample=False, pad_token_id=0)
    assert out.token_ids == g[0, len(prompt):].tolist()


DEFAULT_LANE = ("llama", "qwen3", "gemma2")     # the prompt-logprob check's families by default


def test_prompt_logprobs_equal_transformers_log_softmax(hf_model):
    """Prompt log-probabilities within 1e-4 of HF's, whole, in chunks, and with the prompt's
    blocks cached by the run before (a hit would skip the positions they need: not taken)."""
    if hf_model[0] not in DEFAULT_LANE:
        pytest.skip("checked in the exhaustive lane")
    _prompt_logprobs_equal_transformers(hf_model)


@pytest.mark.exhaustive
def test_prompt_logprobs_equal_transformers_log_softmax_every_family(hf_model):
    if hf_model[0] in DEFAULT_LANE:
        pytest.skip("checked in the default lane")
    _prompt_logprobs_equal_transformers(hf_model)


def _prompt_logprobs_equal_transformers(hf_model) -> None:
    _, ref, llm = hf_model
    ids = torch.randint(3, 300, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.log_softmax(ref(ids).logits[0].float(), dim=-1)
    prompt, params = ids[0].tolist(), SamplingParams(max_tokens=1, prompt_logprobs=2)
    sched = llm.engine.scheduler
    runs = [llm.generate([prompt], params)[0]]
    old_budget, sched.budget = sched.budget, 24
    try:
        runs.append(llm.generate([prompt], params)[0])
    finally:
        sched.budget = old_budget
    for out in runs:
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == PROMPT
        got = torch.tensor([lps[p][prompt[p]] for p in range(1, PROMPT)])
        assert (got - want[torch.arange(PROMPT - 1), ids[0, 1:]]).abs().max() < 1e-4
        top = want[:-1].topk(2)
        assert all(set(top.indices[p - 1].tolist()) <= set(lps[p]) for p in range(1, PROMPT))
    assert runs[1].metrics["num_cached_tokens"] == 0


def test_an_unknown_family_names_the_ones_that_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "vocab_size": 10}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="model_type 'mamba' is not supported.*llama.*qwen3"):
        LLM.from_config({"model": {"path": str(tmp_path)}})


def test_an_unimplemented_rope_scaling_is_refused_not_ignored():
    from twophase.models.families import by_model_type

    cfg = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(ModelError, match="RoPE scaling 'longrope' is not implemented"):
        by_model_type("llama", "here").arch_from_hf(cfg)


SPLIT = {"prefill": {"name": "onnxruntime"}, "decode": {"name": "torch"}}


@pytest.mark.exhaustive          # an export a family
@pytest.mark.parametrize("backend", ["onnxruntime", "iree", "split", "tensorrt"])
def test_graph_backends_trace_each_family_they_claim(hf_model, backend, monkeypatch, tmp_path):
    """ONNX and IREE trace the same decoder: a family whose features they claim gives torch's
    greedy tokens, alone and batched with chunks, over a pool in groups where the family mixes
    windows (``split``: ONNX prefills, torch decodes over the same pool; ``tensorrt``: the
    backend's calls through the stand-in, which runs the ONNX graph); one they do not is
    refused before any export."""
    from helpers import fake_tensorrt

    from twophase.backends.traced import GRAPH_FEATURES, MOE, TRACED_FEATURES
    from twophase.errors import BackendUnavailable

    _, _, llm = hf_model
    if backend == "tensorrt":
        fake_tensorrt.install(monkeypatch, tmp_path)
    cfg = {"model": {"path": llm.model.weights}, "cache": {"num_blocks": 64, "block_size": 8},
           "backend": SPLIT if backend == "split" else
           {"name": backend, "device": "cpu"} if backend == "tensorrt" else {"name": backend},
           "scheduler": {"max_num_batched_tokens": 24, "max_num_seqs": 4}}
    prompts = [list(range(5, 45)), list(range(50, 53)), [(7 * i) % 290 + 5 for i in range(30)]]
    if not llm.model.arch.features() <= (TRACED_FEATURES | MOE if backend == "tensorrt" else GRAPH_FEATURES):
        name = "onnxruntime" if backend == "split" else backend
        with pytest.raises(BackendUnavailable, match=f"{name}: .* not implemented"):
            LLM.from_config(cfg)
        return
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [llm.generate([p], params)[0].token_ids for p in prompts]
    graph = LLM.from_config(cfg)
    assert [o.token_ids for o in graph.generate(prompts, params)] == want
    # a model mixing full and sliding layers is read in groups: its sliding layers hold their window
    mixed = len({s.attention.window for s in llm.model.arch.layers}) > 1
    assert graph.kv_cache.groups is not None and (graph.kv_cache.groups.num_groups > 1) == mixed
    if backend == "tensorrt":
        assert any(c[0] == "IExecutionContext.execute_async_v3" for c in fake_tensorrt.calls)


def _arch(**config):
    from twophase.models.families import arch_from_config

    return arch_from_config({**BASE, **config}, "config.json")


def test_published_config_forms_read_as_transformers_reads_them():
    # Gemma 3 as its hub files state it: no layer_types (a pattern of 6), the head tied by default
    del_tie = {k: v for k, v in {**BASE, "model_type": "gemma3_text", "sliding_window": 128,
                                 "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 12}.items()
               if k != "tie_word_embeddings"}
    from twophase.models.families import arch_from_config

    g = arch_from_config(del_tie, "config.json")
    assert g.tie_word_embeddings
    assert [s.attention.kind for s in g.layers] == (["sliding"] * 5 + ["full"]) * 2
    # Phi-3 mini 4k: a window on every layer, without layer_types
    p = _arch(model_type="phi3", sliding_window=200, pad_token_id=0)
    assert {s.attention.window for s in p.layers} == {200} and "sliding_window" in p.features()
    # a window as long as the context is full attention
    assert "sliding_window" not in _arch(model_type="mistral", sliding_window=512).features()
    # Qwen2 with use_sliding_window: the layers from max_window_layers on slide
    q = _arch(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert [s.attention.window for s in q.layers] == [None, None, 64]
    assert "sliding_window" not in _arch(model_type="qwen2", sliding_window=64).features()


def test_a_config_missing_a_key_names_it():
    from twophase.models.families import arch_from_config

    bad = {k: v for k, v in BASE.items() if k != "num_hidden_layers"}
    with pytest.raises(ModelError, match="a qwen3 config needs 'num_hidden_layers'"):
        arch_from_config({**bad, "model_type": "qwen3"}, "config.json")
    with pytest.raises(ModelError, match="llama3' needs high_freq_factor"):
        _arch(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 64})


def test_gguf_files_of_a_family_not_read_yet_are_refused_by_name(tmp_path):
    import gguf
    import numpy as np

    from twophase.models.gguf import hf_config
    from twophase.models.gguf_file import GGUFFile

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")        # Qwen2-MoE's shared experts: not read
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="GGUF architecture 'qwen2moe' is not supported; the architectures "
                                         "that load: gemma2, gemma3, gpt-oss, granitehybrid, lfm2, llama, "
                                         "phi3, qwen2, qwen3, qwen35, qwen3moe, qwen3next"):
        hf_config(GGUFFile(path))
    # a family that loads, from a file lacking what it must state: the key is named
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="lacks qwen3.attention.head_count"):
        hf_config(GGUFFile(tmp_path / "q.gguf"))
    # a RoPE scaling llama.cpp stores as a tensor (Llama 3.1's rope_freqs): refused, not ignored
    w = gguf.GGUFWriter(str(tmp_path / "l.gguf"), "llama")
    w.add_head_count(4)
    w.add_embedding_length(64)
    w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="holds rope_freqs.weight, Llama 3.1's RoPE scaling as per-frequency "
                                         "factors: not implemented"):
        hf_config(GGUFFile(tmp_path / "l.gguf"))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_model_gives_back_the_blocks_before_its_window(tmp_path, family):
    """A window of 24 over blocks of 8. Mistral slides in every layer: once the prompt is in, a
    sequence holds at most ceil(24 / 8) + 1 blocks however long it grows. Gemma 3 (3 sliding
    layers, 1 full) keeps a group a kind: the full group holds every block, each sliding group
    its window's. Its tokens stay transformers'."""
    ref = tiny_hf_model(family, tmp_path)
    llm = LLM.from_config({"model": {"path": str(tmp_path)}, "cache": {"num_blocks": 64, "block_size": 8}})
    eng = llm.engine
    full_groups = {"mistral": 0, "gemma3": 1}[family]
    assert eng.kv.windows == {"mistral": (24,), "gemma3": (None, 24, 24, 24)}[family]
    prompt = [(11 * i) % 290 + 5 for i in range(80)]
    req = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    held = []
    while not req.finished:
        eng.step()
        if not req.finished:
            ctx = eng.kv.blocks_for(req.num_computed_tokens)
            held.append(eng.kv.num_used_blocks - full_groups * ctx)
    sliding = len(eng.kv.windows) - full_groups
    assert max(held) <= 4 * sliding, held            # the prompt alone fills 10 a group
    assert eng.kv.num_free_blocks == llm.num_blocks
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                         pad_token_id=0)
    assert req.output_token_ids == g[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,tight_blocks", [("mistral", 24), ("gemma3", 80)])
def test_window_release_keeps_tokens_through_preemption_prefix_hits_and_drafts(tmp_path, family, tight_blocks):
    tiny_hf_model(family, tmp_path)
    shared = [(7 * i) % 290 + 5 for i in range(40)]
    prompts = [shared + [100 + i] * (5 + 9 * i) for i in range(6)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def run(**sections):
        cfg = {"model": {"path": str(tmp_path)}, "cache": {"num_blocks": 256, "block_size": 4}}
        llm = LLM.from_config({**cfg, **sections})
        outs = llm.generate(prompts, params)
        assert llm.engine.kv.num_free_blocks == llm.num_blocks
        return [o.token_ids for o in outs], llm.report(outs)

    want, _ = run(cache={"num_blocks": 256, "block_size": 4, "prefix_caching": False})
    tight, rep = run(cache={"num_blocks": tight_blocks, "block_size": 4},
                     scheduler={"max_num_batched_tokens": 32, "max_num_seqs": 6})
    assert rep["preemptions"] > 0 and rep["prefix_cache_hit_rate"] > 0 and tight == want
    drafted, rep = run(speculative={"method": "ngram", "num_tokens": 3})
    assert drafted == want


def test_named_shapes_count_what_their_model_cards_state():
    from twophase.config import load_config
    from twophase.models.param_counts import active_layer_params, group_params, num_params
    from twophase.models.shapes import SHAPES
    from twophase.plan import plan
    from twophase.plan.devices import profile

    cards = {"qwen3-8b": 8_190_735_360, "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_241_732_096,
             "phi-3-mini": 3_821_079_552, "gemma2-9b": 9_241_705_984}
    assert {n: num_params(SHAPES[n]) for n in cards} == cards
    moe = SHAPES["qwen3-30b-a3b"]
    g = group_params(moe)
    active = active_layer_params(moe) * moe.num_layers + g["embedding"] + g["head"] + g["norms"]
    assert round(num_params(moe) / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9     # "3.3B activated"
    p = plan(load_config({"model": {"name": "qwen3-8b", "weights": "random"}}), profile("h200"), context=8192)
    assert p.to_dict()["totals"]["weights"] == 2 * 8_190_735_360
