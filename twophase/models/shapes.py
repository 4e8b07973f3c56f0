"""The named shapes that load with random weights (Llama-family hyper-parameters)."""

from __future__ import annotations

from twophase.arch import ModelArch
from twophase.models.families.llama import arch as llama

_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

SHAPES: dict[str, ModelArch] = {
    # a few-MB shape for fast tests
    "tiny": llama(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
                  eos_token_ids=(2,), bos_token_id=1),
    "smollm2-135m": llama(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          max_position_embeddings=8192, rope_theta=100000.0,
                          tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1),
    "llama3-1b": llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                       max_position_embeddings=131072, rope_theta=500000.0,
                       tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0),
                       eos_token_ids=(128001,), bos_token_id=128000),
    "llama3-8b": llama(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       max_position_embeddings=131072, rope_theta=500000.0,
                       rope_scaling=dict(_LLAMA3_SCALING), eos_token_ids=(128001,),
                       bos_token_id=128000),
    "llama3-70b": llama(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=dict(_LLAMA3_SCALING), eos_token_ids=(128001,),
                        bos_token_id=128000),
}


def named_shape(name: str, num_layers: int | None = None) -> ModelArch:
    arch = SHAPES[name]
    return arch.with_layers(num_layers) if num_layers else arch


def _hf(model_type: str, **c) -> ModelArch:
    """A shape from the fields of its published ``config.json`` (read by its family)."""
    from twophase.models.families import arch_from_config

    return arch_from_config({"model_type": model_type, **c}, f"the {model_type} shape")


# planning shapes of other families, from their config.json; parameter counts as their model cards
SHAPES.update({
    "qwen2.5-7b": _hf("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      max_position_embeddings=32768, rope_theta=1e6, eos_token_id=151645),
    "qwen3-8b": _hf("qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=40960, rope_theta=1e6, eos_token_id=151645),
    "qwen3-30b-a3b": _hf("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1e6, eos_token_id=151645),
    # gpt-oss: GptOssConfig's defaults are the 120b; the 20b has 24 layers of 32 experts
    **{name: _hf("gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=experts,
                 num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                  "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
                 bos_token_id=199998, eos_token_id=[200002, 199999, 200012])
       for name, layers, experts in (("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32))},
    # DeepSeek: DeepseekV3Config's defaults (V3/R1, 671B) and DeepSeek-V2-Lite's config.json
    "deepseek-v3": _hf("deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                       moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                       num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                       kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                       n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                       max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                       rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek-v2-lite": _hf("deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                            num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
                            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
                            qk_nope_head_dim=128, topk_method="greedy", num_experts_per_tok=6,
                            first_k_dense_replace=1, max_position_embeddings=163840, rms_norm_eps=1e-6,
                            bos_token_id=100000, eos_token_id=100001,
                            rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "mistral-7b": _hf("mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=32768, sliding_window=4096, eos_token_id=2),
    "mixtral-8x7b": _hf("mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                        rope_theta=1e6, eos_token_id=2),
    "phi-3-mini": _hf("phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, sliding_window=2047, eos_token_id=32000),
    "gemma2-9b": _hf("gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                     num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                     max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                     hidden_activation="gelu_pytorch_tanh", eos_token_id=1),
    # transformers' Qwen3NextConfig defaults with the published model's context and RoPE base:
    # 36 Gated DeltaNet layers (a state a sequence) and 12 of gated attention, 512 experts, top 10
    "qwen3-next-80b-a3b": _hf("qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                              norm_topk_prob=True, max_position_embeddings=262144, rope_theta=1e7,
                              eos_token_id=151645),
    # Qwen3.5-27B's published config.json (the multimodal form: the text model's keys under
    # text_config): 48 Gated DeltaNet layers (16 key heads, 48 value heads of 128) and 16 of gated
    # attention. transformers' Qwen3_5TextConfig defaults name this checkpoint in their docstring
    # but are a smaller shape (hidden 4096, 32 layers): these numbers are the published file's
    "qwen3.5-27b": _hf("qwen3_5", tie_word_embeddings=False, text_config=dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=248044)),
    # LFM2-1.2B's published config.json: 10 short-convolution layers (3 taps) and 6 of attention
    # (full_attn_idxs); block_ff_dim 12288 auto-adjusted to 2/3 of it (8192, a multiple of 256)
    "lfm2-1.2b": _hf("lfm2", vocab_size=65536, hidden_size=2048, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, block_ff_dim=12288,
                     block_auto_adjust_ff_dim=True, block_multiple_of=256, full_attn_idxs=[2, 5, 8, 10, 12, 14],
                     conv_L_cache=3, tie_embedding=True, rope_theta=1e6, max_position_embeddings=128000),
    # the built-in Gemma 3 270M, planned before its file is fetched
    "gemma3-270m": _hf("gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                       num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
                       rope_theta=1e6, rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                       bos_token_id=2, eos_token_id=1),
    # its global layers' linear RoPE scaling (factor 8) left out: the kit refuses it, the plan
    # does not need it
    "gemma3-27b": _hf("gemma3_text", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                      num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                      max_position_embeddings=131072, sliding_window=1024, query_pre_attn_scalar=168,
                      rope_theta=1e6, rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                      eos_token_id=1),
})
