"""YaRN RoPE scaling (Qwen3's long context, DeepSeek, gpt-oss) against transformers: the
frequencies and attention factor of its own computation for each way a config states them, and
a tiny Qwen3 with YaRN whose logits and greedy tokens are transformers'."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import BASE

from twophase import LLM, SamplingParams
from twophase.errors import ModelError
from twophase.models.layers.rotary import attention_factor, check_scaling, inv_freq

transformers = pytest.importorskip("transformers")

# Qwen3's published form; DeepSeek V3's (mscale, mscale_all_dim, beta 32/1); a factor read
# from max_position_embeddings; gpt-oss's (no truncation); a factor of 1 (no attention change)
YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},
    {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512},
]


def _hf(scaling: dict, theta: float = 10000.0):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.Qwen3Config(**{**BASE, "head_dim": 16}, rope_parameters={**scaling, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


@pytest.mark.parametrize("scaling", YARN)
def test_yarn_frequencies_and_attention_factor_are_transformers(scaling):
    want_inv, want_factor = _hf(scaling)
    ours = check_scaling(scaling, BASE["max_position_embeddings"])
    torch.testing.assert_close(inv_freq(16, 10000.0, ours), want_inv, rtol=1e-6, atol=0)
    assert attention_factor(ours) == pytest.approx(want_factor, rel=1e-12)


def test_a_yarn_model_gives_transformers_logits_and_greedy_tokens(tmp_path):
    """Positions past the original 32 tokens, where YaRN's frequencies and its attention factor
    (1.139 at factor 4, folded into the query scale) both change the logits."""
    torch.manual_seed(0)
    scaling = YARN[0]
    ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**BASE, "head_dim": 16}, rope_parameters={**scaling, "rope_theta": 10000.0})).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path)
    llm = LLM.from_config({"model": {"path": str(tmp_path)}, "cache": {"num_blocks": 64, "block_size": 8}})
    assert llm.model.arch.scale == pytest.approx(16 ** -0.5 * attention_factor(check_scaling(scaling)) ** 2)
    ids = torch.randint(3, 300, (1, 80), generator=torch.Generator().manual_seed(1))
    from helpers.models import prefill_all_logits

    got = prefill_all_logits(llm, [ids[0].tolist()])
    with torch.no_grad():
        want = ref(ids).logits[0]
        greedy = ref.generate(ids[:, :40], max_new_tokens=12, do_sample=False)[0, 40:].tolist()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    out = llm.generate([ids[0, :40].tolist()], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == greedy


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": -1.0, "original_max_position_embeddings": 32}, "factor above 0"),
])
def test_a_yarn_config_missing_what_it_needs_is_refused_by_name(bad, match):
    with pytest.raises(ModelError, match=match):
        check_scaling(bad)


def test_yarn_where_it_cannot_be_computed_is_refused_by_name():
    """Partial rotary (the attention factor is folded into the query scale, which every
    dimension takes) and Gemma's per-layer-type RoPE: refused, not run with plain RoPE."""
    from twophase.models.decoder import rope_inv_freq
    from twophase.models.families import by_model_type

    cfg = {**BASE, "model_type": "phi3", "partial_rotary_factor": 0.5, "rope_scaling": YARN[0]}
    arch = by_model_type("phi3", "here").arch_from_hf(cfg)
    with pytest.raises(ModelError, match="partial rotary"):
        rope_inv_freq(arch)
    gemma = {**BASE, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": YARN[0]}
    with pytest.raises(ModelError, match="RoPE scaling 'yarn' on Gemma"):
        by_model_type("gemma2", "here").arch_from_hf(gemma)
