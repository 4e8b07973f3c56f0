"""Models whose cache is mostly a state (Qwen3-Next, Qwen3.5: Gated DeltaNet three layers in
four; LFM2: gated short convolutions, here three layers in four; Granite 4: Mamba-2 layers)
against HF transformers on the same random weights: logits at every position of a whole prompt
and of the same prompt in chunks (the state carried from chunk to chunk), greedy tokens as HF's
``generate``, batching with preemption, prefix hits, drafts, disaggregation, and what the engine
refuses for them yet."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_models import STATE_FAMILIES, tiny_hf_model

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.testing import assert_greedy_match, logprob_gaps

transformers = pytest.importorskip("transformers")

# each family's state layers as a refusal names them, and a config key that sizes their weights
# (with a value the checkpoint's weights do not have)
# how a backend without the family's state layers names them
REFUSED_AS = {"qwen3_5": "Gated DeltaNet", "qwen3_next": "Gated DeltaNet", "lfm2": "short-convolution",
              "granitemoehybrid": "Mamba-2"}
# a config.json value its tiny checkpoint's state layers disagree with
WRONG_DIMS = {"qwen3_5": ("linear_num_value_heads", 8), "qwen3_next": ("linear_num_value_heads", 8),
              "lfm2": ("conv_L_cache", 4), "granitemoehybrid": ("mamba_d_state", 32)}


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
    assert len(llm.engine.kv._free_slots) == llm.engine.kv.running_slots


def test_a_prefix_hit_restores_the_state_saved_at_a_boundary_and_gives_the_cold_tokens(hf):
    """Snapshots every 32 tokens, 3 of them kept: requests sharing a 100-token prefix hit the
    96 tokens that end on a boundary (K/V blocks and the state saved there) and get exactly the
    tokens they get cold; later prompts evict the oldest snapshots, and a hit never uses one
    that was overwritten."""
    folder, _, _ = hf
    rng = random.Random(1)
    shared = [rng.randrange(3, 300) for _ in range(100)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    others = [[rng.randrange(3, 300) for _ in range(70)] for _ in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    cold = _llm(folder, cache={"num_blocks": 64, "prefix_caching": False})
    want = [cold.generate([p], params)[0] for p in prompts + others + prompts[:1]]
    llm = _llm(folder, cache={"num_blocks": 128, "block_size": 16, "state_snapshot_every": 32,
                              "state_snapshots": 3})
    got = [llm.generate([p], params)[0] for p in prompts + others + prompts[:1]]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), f"prompt {i}")
    hits = [o.metrics["num_cached_tokens"] for o in got]
    assert hits[0] == 0 and hits[1:4] == [96, 96, 96], hits
    assert hits[-1] < 96, hits            # the shared prefix's snapshots were evicted by others


def test_drafts_give_the_tokens_of_decoding_without_them(hf):
    """n-gram drafts: each prompt is ``p + (p's own continuation) + p``, so the lookup drafts
    that continuation again, which the model partly repeats. Kept drafts advance the state; a
    rejected one sends the sequence back to its state before the verify step, and its kept
    tokens are computed again. The tokens equal those without drafts; some drafts were kept,
    some not."""
    folder, _, _ = hf
    rng = random.Random(2)
    plain_llm = _llm(folder)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = []
    for _ in range(4):
        p = [rng.randrange(3, 300) for _ in range(12)]
        prompts.append(p + plain_llm.generate([p], params)[0].token_ids + p)
    plain = plain_llm.generate(prompts, params)
    llm = _llm(folder, speculative={"method": "ngram", "num_tokens": 3})
    drafted = llm.generate(prompts, params)
    spec = llm.report(drafted)["speculative"]
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec
    for i, (d, p) in enumerate(zip(drafted, plain)):
        assert_greedy_match(d.token_ids, p.token_ids, logprob_gaps(p), f"prompt {i}")
    assert len(llm.engine.kv._free_slots) == llm.engine.kv.running_slots


def test_disaggregated_prefill_and_decode_move_the_state_with_the_blocks(hf):
    """A prefill engine runs each prompt and its first token; a decode engine pulls every block
    of the prompt and its state at the prompt's end (as bytes, as the Ray workers send them) and
    goes on: one engine's tokens, and every block and slot back on both sides."""
    from twophase.core.kv_transfer import (
        KVTransferParams,
        LocalTransport,
        continues_on_peer,
        first_token_params,
        joined,
    )

    folder, _, _ = hf
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 16, 37, 60)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    alone = _llm(folder).generate(prompts, params)
    p, d = _llm(folder), _llm(folder)
    d.engine.connector.transport = LocalTransport({p.engine.connector.engine_id: p.engine.connector})

    def run(engine, jobs):
        ids = [engine.add_request(q, sp, kv_transfer=t, first_token_ids=first).request_id for q, sp, t, first in jobs]
        done = {}
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.output is not None:
                    done[delta.request_id] = delta.output
        return [done[i] for i in ids]

    firsts = run(p.engine, [(q, first_token_params(params), KVTransferParams(do_remote_decode=True), ())
                            for q in prompts])
    assert all(continues_on_peer(f) for f in firsts)
    rest = run(d.engine, [(q, params, KVTransferParams.from_dict(f.kv_transfer_params), f.token_ids)
                          for q, f in zip(prompts, firsts)])
    pulled = sorted(t for t, _, _ in d.engine.connector.transfers)     # every prompt pulled whole
    assert pulled == sorted(len(q) for q in prompts), pulled
    for i, (f, r, a) in enumerate(zip(firsts, rest, alone)):
        assert_greedy_match(joined(f, r, params).token_ids, a.token_ids, logprob_gaps(a), f"prompt {i}")
    assert p.engine.kv.num_used_blocks == d.engine.kv.num_used_blocks == 0
    assert len(d.engine.kv._free_slots) == d.engine.kv.running_slots


def test_a_draft_model_gives_the_tokens_of_decoding_without_it(hf, tmp_path_factory):
    """A draft model that attends in every layer (transformers' tiny Llama, the same 300 token
    ids) proposes for the state model: it rarely guesses right, so nearly every verify step
    rolls the state back, and the tokens equal those without drafts."""
    folder, _, _ = hf
    draft = tmp_path_factory.mktemp("draft")
    tiny_hf_model("llama", draft)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (7, 30)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    plain = _llm(folder).generate(prompts, params)
    llm = _llm(folder, speculative={"method": "draft", "num_tokens": 2, "draft": {"path": str(draft)}})
    drafted = llm.generate(prompts, params)
    assert llm.report(drafted)["speculative"]["draft_tokens"] > 0
    for i, (d, p) in enumerate(zip(drafted, plain)):
        assert_greedy_match(d.token_ids, p.token_ids, logprob_gaps(p), f"prompt {i}")


def test_what_state_layers_do_not_do_yet_is_said(hf, caplog):
    from twophase.errors import ConfigError

    folder, _, _ = hf
    with pytest.raises(ConfigError, match="draft .* has state layers"):
        _llm(folder, speculative={"method": "draft", "num_tokens": 2, "draft": {"path": str(folder)}})
    caplog.set_level("INFO")
    llm = _llm(folder, cache={"num_blocks": 64, "state_snapshots": 0, "dtype": "float16"})
    assert not llm.engine.kv.prefix_caching and "prefix caching off" in caplog.text
    assert "float16 holds the attention layers' K/V" in caplog.text and "in float32" in caplog.text
    assert llm.loaded.layout.state is not None and llm.loaded.layout.state.bytes_per_sequence() > 0
    assert len(llm.kv_cache.states) == 3                 # three state layers, one attends


@pytest.mark.parametrize("backend", ["onnxruntime", "iree", "native"])
def test_a_backend_without_state_layers_refuses_them_by_name(hf, backend):
    """native computes none; onnxruntime and iree decode them only."""
    from twophase.errors import TwophaseError

    folder, _, name = hf
    want = REFUSED_AS[name]
    if backend in ("onnxruntime", "iree"):
        want = f"{want}.* in prefill"
    with pytest.raises(TwophaseError, match=want):
        _llm(folder, backend={"name": backend})


# the state families whose decodes the graph backends compute: every one, Qwen3-Next's and
# Granite 4's experts (with their shared expert) traced too, and a Granite 4 without experts
GRAPH_DECODES = ("granitemoehybrid", "granitemoehybrid_dense", "lfm2", "qwen3_5", "qwen3_next")
# each graph backend and the module it needs
GRAPH_BACKENDS = {"onnxruntime": "onnxruntime", "iree": "iree.turbine"}


# the default lane: one pair (a graph backend decoding a hybrid); every pair with -m exhaustive
# (iree's decode graph is the same trace, and test_iree runs iree in the default lane)
DEFAULT_LANE = {("qwen3_5", "onnxruntime")}


@pytest.mark.parametrize("family, backend", [
    pytest.param(f, b, marks=() if (f, b) in DEFAULT_LANE else pytest.mark.exhaustive)
    for f in GRAPH_DECODES for b in GRAPH_BACKENDS])
def test_prefill_on_torch_and_decode_on_a_graph_backend_give_torch_s_tokens(family, backend, tmp_path):
    """One pool, torch prefilling and a graph backend decoding: its step graph (IREE's
    ``decode`` entry point) takes the decodes' states gathered at their slots and returns the
    new ones, written back there. States are saved every 16 tokens, so the first request's is
    saved during its decodes (the copy rides on a graph step) and the second, its first 16
    tokens and 2 more, starts from that snapshot; then a batch of decodes of unequal lengths.
    Every request gets torch's tokens; a chunk handed to the graph backend is refused by name."""
    pytest.importorskip(GRAPH_BACKENDS[backend])
    from twophase.errors import BackendUnavailable

    folder = tmp_path / "model"
    tiny_hf_model(family, folder)
    rng = random.Random(4)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    cache = {"num_blocks": 64, "block_size": 16, "state_snapshot_every": 16}
    graph = _llm(folder, cache=cache, backend={"prefill": {"name": "torch"}, "decode": {"name": backend}})
    ref = _llm(folder, cache=cache)
    first = [rng.randrange(3, 300) for _ in range(10)]
    prompts = [first + ref.generate([first], params)[0].token_ids[:6] + [5, 6]]     # 16 tokens, then 2
    prompts += [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 7, 25, 40)]
    want = [ref.generate([first], params)[0]] + ref.generate(prompts, params)
    got = [graph.generate([first], params)[0]] + graph.generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_greedy_match(g.token_ids, w.token_ids, logprob_gaps(w), f"prompt {i}")
    assert got[1].metrics["num_cached_tokens"] == 16, got[1].metrics
    assert graph.decode_backend.name == backend and graph.report(got)["steps_by_mix"]["decode"]["steps"]
    eng = graph.engine
    req = eng.add_request(first, SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, len(first))
    named = REFUSED_AS[family.removesuffix("_dense")]
    with pytest.raises(BackendUnavailable, match=f"{named}.* in prefill"):
        graph.decode_backend.prefill(prefill_batch([(req, 0, len(first))], eng.kv))


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
    key, value = WRONG_DIMS[name]
    cfg[key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TwophaseError, match=r"disagree with its config.json: .*mixer"):
        _llm(bad)


def test_lfm2_as_its_published_config_states_it_reads_as_transformers_reads_it():
    """LFM2-1.2B's config.json: ``full_attn_idxs`` in place of ``layer_types``, ``block_ff_dim``
    in place of ``intermediate_size``, ``tie_embedding``; the MLP as wide as HF's ``Lfm2MLP``."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from twophase.models.families import arch_from_config

    cfg = {"vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True,
           "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
           "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5, "tie_embedding": True, "rope_theta": 1e6}
    arch = arch_from_config({**cfg, "model_type": "lfm2"}, "config.json")
    ref = transformers.Lfm2Config(**cfg)
    with torch.device("meta"):
        width = Lfm2MLP(ref).w1.out_features
    assert arch.intermediate_size == width == 8192
    assert [s.attends for s in arch.layers] == [t != "conv" for t in ref.layer_types]
    assert arch.tie_word_embeddings == ref.tie_word_embeddings is True
    assert arch.rope_theta == 1e6 and "short_conv" in arch.features() and "qk_norm" in arch.features()


def test_structured_outputs_hold_on_a_hybrid_and_across_backends(tmp_path, default_llm):
    """A tiny Qwen3.5 carrying the default model's tokenizer: a JSON schema's answer validates
    (the ``jsonschema`` validator), and prefill on torch with decode on onnxruntime gives the same
    constrained tokens."""
    import json
    import shutil

    jsonschema = pytest.importorskip("jsonschema")
    from helpers.hf_models import hf_config

    from twophase.paths import cache_dir
    from twophase.structured import StructuredOutputs

    cfg = hf_config("qwen3_5")
    cfg.vocab_size = default_llm.spec.arch.vocab_size
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cache_dir() / "models" / "smollm2-135m-instruct" / name, tmp_path / name)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yy", "zzz"]},
                                               "n": {"type": "integer", "maximum": 99}},
              "required": ["k", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, structured=StructuredOutputs(json=schema))
    prompts = ["Answer in JSON.", "a longer prompt, to be prefilled in more than one chunk " * 3]
    torch_only = _llm(tmp_path, scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4})
    want = torch_only.generate(prompts, params)
    for o in want:
        jsonschema.validate(json.loads(o.text), schema)
    split = _llm(tmp_path, backend={"prefill": {"name": "torch"}, "decode": {"name": "onnxruntime"}})
    assert [o.token_ids for o in split.generate(prompts, params)] == [o.token_ids for o in want]


def test_choices_fork_the_state_and_equal_the_prompt_sent_alone(hf):
    """``n`` choices of a hybrid: each takes the attention blocks and a copy of the state its
    parent reached at the last whole block, then computes its tail itself."""
    folder, _, _ = hf
    llm = _llm(folder, cache={"num_blocks": 64, "block_size": 16})
    prompt = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=3)
    outs = llm.generate([prompt], params)
    alone = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=9 + i))[0]
             for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert [o.metrics["num_cached_tokens"] for o in outs[1:]] == [32, 32]
