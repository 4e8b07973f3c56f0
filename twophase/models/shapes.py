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
