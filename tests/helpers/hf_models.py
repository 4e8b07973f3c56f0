"""Tiny HF checkpoints of each family, built by transformers from a config with seeded random
weights: the independent reference every family is checked against."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}

GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def hf_config(family: str):
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**BASE, attention_bias=True),
        "qwen2": lambda: t.Qwen2Config(**BASE),
        "qwen3": lambda: t.Qwen3Config(**{**BASE, "head_dim": 24}),
        "mistral": lambda: t.MistralConfig(**BASE, sliding_window=24),
        "gemma2": lambda: t.Gemma2Config(**BASE, sliding_window=24, query_pre_attn_scalar=20,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
        "gemma3": lambda: t.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 4}, sliding_window=24,
                                             query_pre_attn_scalar=20,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                             rope_parameters=GEMMA3_ROPE),
        "phi3": lambda: t.Phi3Config(**{**BASE, "pad_token_id": 0},
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}),
        "mixtral": lambda: t.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**BASE, num_experts=6, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True,
                                              mlp_only_layers=[1]),
        # sliding (24) and full layers alternating, YaRN past an original context of 32, sinks,
        # four experts of which two a token, every weight biased
        "gpt_oss": lambda: t.GptOssConfig(**{**BASE, "intermediate_size": 32, "max_position_embeddings": 128},
                                          num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                                          rope_parameters=GPT_OSS_ROPE),
        "deepseek_v2": lambda: deepseek_config("deepseek_v2"),
        "deepseek_v3": lambda: deepseek_config("deepseek_v3"),
        "qwen3_next": lambda: t.Qwen3NextConfig(**{**BASE, "num_hidden_layers": 4}, **DELTANET, num_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48, mlp_only_layers=[1]),
        "qwen3_5": lambda: t.Qwen3_5TextConfig(**{**BASE, "num_hidden_layers": 4}, **DELTANET),
        "lfm2": lambda: t.Lfm2Config(**{**BASE, "num_hidden_layers": 4, **LFM2}),
        "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(
            **{**BASE, "num_hidden_layers": 4, "intermediate_size": 32}, **MAMBA2,
            layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=48, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.1, logits_scaling=2.0),
        # Granite 4 without experts (its dense models): Mamba-2 layers a graph backend computes
        "granitemoehybrid_dense": lambda: t.GraniteMoeHybridConfig(
            **{**BASE, "num_hidden_layers": 4, "intermediate_size": 32}, **MAMBA2,
            layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
            shared_intermediate_size=48, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.1, logits_scaling=2.0),
    }[family]()


# Gated DeltaNet layers: 2 key heads of 16, 4 value heads of 16 (two a key head), 4 taps
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4)
# LFM2: gated short convolutions of 3 taps (with biases) in three layers of four; an MLP width
# derived as HF does (2/3 of 144, times 1.5, rounded up to 32: 160); tied embeddings
LFM2 = dict(layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3, conv_bias=True,
            intermediate_size=144, block_ffn_dim_multiplier=1.5, block_multiple_of=32, norm_eps=1e-6,
            tie_word_embeddings=True)
# Mamba-2 layers: 4 heads of 32 (hidden 64, expanded twice), B and C in 2 groups of 16, 4 taps;
# a chunked scan of 16 tokens, so 150 tokens cross several; no RoPE in the attention layer
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=16)
STATE_FAMILIES = ("granitemoehybrid", "lfm2", "qwen3_5", "qwen3_next")     # their cache is (mostly) a state a sequence

FAMILIES = ("deepseek_v2", "deepseek_v3", "gemma2", "gemma3", "gpt_oss", "llama", "mistral", "mixtral", "phi3", "qwen2",
            "qwen3", "qwen3_moe")


def tiny_hf_model(family: str, folder: Path):
    """The model, saved to ``folder`` (safetensors and config.json)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    with torch.no_grad():                     # larger weights: sharper logits, fewer near-ties
        for name, p in model.named_parameters():     # biases (gpt-oss's experts' are [E, out]) drawn
            p.add_(torch.randn_like(p) * 0.1) if p.dim() == 1 or name.endswith("_bias") else p.mul_(4.0)
        for name, b in model.named_buffers():     # DeepSeek V3's choosing bias (zeros as initialised)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(folder)
    return model


def tiny_qwen3_5_multimodal(folder: Path, tie: bool = False):
    """Qwen3.5 in its published form, ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``):
    the tiny ``qwen3_5`` text model under ``text_config`` and a one-block vision tower; the head
    tied or not by the top-level key (the text config's own says the opposite), as transformers
    ties it. Saved to ``folder`` as ``tiny_hf_model`` saves."""
    import transformers as t

    torch.manual_seed(0)
    text = {**hf_config("qwen3_5").to_dict(), "tie_word_embeddings": not tie}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, num_position_embeddings=16)
    model = t.Qwen3_5ForConditionalGeneration(
        t.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def hf_pooled(base, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """HF's final hidden states (after the final norm: ``last_hidden_state``) of ``ids``, pooled
    (``last``, ``mean`` or ``cls``), L2-normalised where asked: what an embedding must equal."""
    with torch.no_grad():
        h = base(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


# DeepSeek: latents of 32 (and q's of 24 in V3), 4 heads of 16 + 8 rotated query/key values and
# 12 value values; 8 experts of 32 in 4 groups (2 chosen from), top 2, shared experts; the first
# layer dense
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
           num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1,
           rms_norm_eps=1e-6)


def deepseek_config(family: str):
    import transformers as t

    base = {**BASE, "num_key_value_heads": 4, "head_dim": 8}
    if family == "deepseek_v3":
        return t.DeepseekV3Config(**base, **MLA, q_lora_rank=24, n_shared_experts=1)
    return t.DeepseekV2Config(**base, **MLA, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
                              routed_scaling_factor=1.5)
