"""DeepSeek V2/V3 beyond ``test_families`` (which checks both against transformers, whole, in
chunks, served): the decode form (attention over the latents with ``kv_b`` absorbed) against the
prefill form on the same cache; the static form the graph backends trace, and DeepSeek on ONNX
Runtime against torch; the pool holding one latent a token; what is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers.hf_models import tiny_hf_model

from twophase import LLM
from twophase.arch import AttentionSpec, LayerSpec, MLASpec, MLPSpec, ModelArch
from twophase.errors import ConfigError, ModelError
from twophase.graph.inputs import layer_blocks
from twophase.models.graph_attention import GraphMeta
from twophase.models.layers.mla import LatentAttention, gather_latents, write_latent

pytest.importorskip("transformers")

MLA = MLASpec(kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
ARCH = ModelArch("deepseek_v3", vocab_size=16, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=24,
                 layers=(LayerSpec(AttentionSpec(), MLPSpec(16)),), mla=MLA, rotary_dim=8)


def test_absorbed_decode_equals_the_expanded_form_on_a_paged_cache():
    """Two sequences of 37 and 100 tokens in blocks of 8 taken out of order: each decode query
    over its latents with ``kv_b`` folded in gives what making every head's keys and values
    from them gives."""
    torch.manual_seed(0)
    layer = LatentAttention(ARCH).eval().requires_grad_(False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    pool = torch.zeros(1, 40, 1, 8, MLA.latent_dim)
    order = torch.randperm(40)
    tables = torch.stack([order[:13], order[13:26]])
    lens = torch.tensor([37, 100])
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        write_latent(pool, torch.randn(n, MLA.latent_dim), tables[b][pos // 8] * 8 + pos % 8)
    q_nope, q_pe = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    got = layer.absorbed(q_nope, q_pe, pool, tables, lens)
    ctx = gather_latents(pool, tables, torch.float32)
    for b, n in enumerate(lens.tolist()):
        want = layer.expanded(q_nope[b:b + 1], q_pe[b:b + 1], ctx[b, :n], n - 1)[0]
        assert float((got[b] - want).abs().max() / want.abs().max()) < 1e-5


def test_the_traced_form_of_a_mixed_step_equals_the_eager_forms():
    """The graph's one dataflow (``LatentAttention.graph``, run by torch here) over a step of two
    decodes (37 and 20 tokens cached) and two padded chunks (5 tokens on nothing cached, 3 on
    16), against the eager expanded form on each sequence's cached latents and its own."""
    torch.manual_seed(1)
    layer = LatentAttention(ARCH).eval().requires_grad_(False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    pool = torch.zeros(1, 1, 40, 1, 8, MLA.latent_dim)
    tables = torch.randperm(40)[:24].view(4, 6)
    cached, new = [37, 20, 0, 16], [1, 1, 5, 3]
    for b, n in enumerate(cached):
        pos = torch.arange(n)
        write_latent(pool[0], torch.randn(n, MLA.latent_dim), tables[b][pos // 8] * 8 + pos % 8)
    T = sum(new)
    q_nope, q_pe, latent = torch.randn(T, 4, 16), torch.randn(T, 4, 8), torch.randn(T, MLA.latent_dim)
    blocks = layer_blocks(tables, tuple(pool.shape), None)                     # [1, 4, 6]
    meta = GraphMeta(torch.tensor([0, 1]), blocks[:, :2, :5], torch.tensor([37, 20]),
                     torch.tensor([[2, 3, 4, 5, 6], [7, 8, 9, T, T]]), blocks[:, 2:, :2], torch.tensor([0, 16]),
                     torch.tensor([5, 3]))
    got = layer.graph(q_nope, q_pe, latent, pool, meta)
    first = 0
    for b, (c, n) in enumerate(zip(cached, new)):
        ctx = torch.cat([gather_latents(pool[0], tables[b:b + 1], torch.float32)[0, :c], latent[first:first + n]])
        want = layer.expanded(q_nope[first:first + n], q_pe[first:first + n], ctx, c)
        assert float((got[first:first + n] - want).abs().max() / want.abs().max()) < 1e-5, b
        first += n


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    tiny_hf_model("deepseek_v3", folder)
    return folder


def test_the_pool_holds_one_latent_a_token_in_each_layer(v3):
    llm = LLM.from_config({"model": {"path": str(v3)}, "cache": {"num_blocks": 32, "block_size": 8}})
    pool = llm.kv_cache.pool
    assert tuple(pool.shape) == (3, 1, 32, 1, 8, 32 + 8)          # layers, one plane, blocks, one row
    assert [s.kind for s in llm.loaded.layout.specs] == ["latent"]
    assert llm.loaded.layout.slot_bytes_per_token == 40 * 4


def test_onnx_runtime_gives_torch_s_tokens_and_log_probabilities(v3):
    """DeepSeek V3 (latent attention, sigmoid routing in groups with a choosing bias, shared
    experts, a first dense layer) traced and run by ONNX Runtime, its experts in the fused
    operator: steps that mix a prompt's chunks with other sequences' decodes, one with nothing
    decoding (the graph's decode group empty)."""
    from twophase import SamplingParams

    prompts = [list(range(5, 45)), list(range(50, 53)), [(7 * i) % 290 + 5 for i in range(30)]]
    p = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    cfg = {"model": {"path": str(v3)}, "cache": {"num_blocks": 64, "block_size": 8},
           "scheduler": {"max_num_batched_tokens": 24, "max_num_seqs": 4}}
    want = LLM.from_config(cfg).generate(prompts, p)
    got = LLM.from_config({**cfg, "backend": {"name": "onnxruntime"}}).generate(prompts, p)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert [lp[t] for t, lp in zip(g.token_ids, g.logprobs)] == \
            pytest.approx([lp[t] for t, lp in zip(w.token_ids, w.logprobs)], abs=1e-4)


def test_a_cache_format_that_cannot_hold_the_latent_names_it(v3):
    with pytest.raises(ConfigError, match=r"runs of 32 values; this model's latent is 40 values a token "
                                          r"\(kv_lora_rank 32 \+ qk_rope_head_dim 8\)"):
        LLM.from_config({"model": {"path": str(v3)}, "cache": {"num_blocks": 32, "dtype": "int8"}})


def test_a_routing_mode_not_implemented_is_named(v3):
    from twophase.models.families import arch_from_config

    config = json.loads((v3 / "config.json").read_text())
    with pytest.raises(ModelError, match="DeepSeek V3 routing 'noaux_tc' with 'softmax' scores is not implemented"):
        arch_from_config({**config, "scoring_func": "softmax"}, "config.json")
    with pytest.raises(ModelError, match="DeepSeek V2 routing 'group_limited_top3' .* not implemented"):
        arch_from_config({**config, "model_type": "deepseek_v2", "topk_method": "group_limited_top3"}, "config.json")


def test_plan_gives_the_latent_beside_per_head_k_and_v(tmp_path):
    r = subprocess.run([sys.executable, "-m", "twophase", "plan", "--model", "deepseek-v3", "--device", "h200",
                        "--quantization", "q4", "--json", "p.json", "--plot", ""],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["kv_bytes_per_token"] == 61 * 576 * 2              # 61 layers of 576 bf16 values
    out = " ".join(r.stdout.split())
    assert "latent cache: 576 values a token a layer (kv_lora_rank 512 + rotary key 64) shared by 128 heads" in out
    assert f"each head's K and V would take {61 * 128 * (192 + 128) * 2:,} B (x71)" in out
    assert "36.63B of 671.03B parameters" in out                 # its card: 37B active of 671B


def test_a_latent_pool_round_trips_through_the_host_tier(v3, tmp_path):
    """A prefix the pool evicted comes back from host memory into a latent pool and gives the
    tokens (and log-probabilities) computed from nothing."""
    from twophase import SamplingParams

    a, b, c = list(range(5, 60)), list(range(100, 160)), list(range(200, 260))
    p = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    cache = {"num_blocks": 24, "block_size": 4}
    cold = LLM.from_config({"model": {"path": str(v3)}, "cache": cache}).generate([a], p)[0]
    llm = LLM.from_config({"model": {"path": str(v3)}, "cache": {**cache, "offload": {"host_gib": 0.01}}})
    llm.generate([a], p)
    llm.generate([b], p)
    llm.generate([c], p)                    # 24 blocks: a's are gone from the pool now
    again = llm.generate([a], p)[0]
    assert again.metrics["num_cached_tokens"] == 52 and llm.engine.kv.restored["host"] == 13
    assert again.token_ids == cold.token_ids
    assert [lp[t] for t, lp in zip(again.token_ids, again.logprobs)] == \
        pytest.approx([lp[t] for t, lp in zip(cold.token_ids, cold.logprobs)], abs=1e-5)


def test_the_roofline_reads_the_latent_not_per_head_k_and_v():
    """``twophase bench``'s and the simulator's decode bytes: a cached token costs a layer its
    576-value latent, not 128 heads' keys and values."""
    from twophase.bench.roofline import CostModel
    from twophase.models.shapes import SHAPES

    cost = CostModel(SHAPES["deepseek-v3"], weight_bytes=2, kv_bytes=2)
    assert cost.layer_kv_bytes == 576 * 2
    few, many = cost.decode(1, 1024), cost.decode(1, 2048)
    assert many.bytes - few.bytes == pytest.approx(1024 * 61 * 576 * 2)
