"""Llama-family hyper-parameters and the named shapes that load with random weights."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Llama-3 style RoPE scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaArch":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> "LlamaArch":
        """From an HF ``config.json`` of a Llama-family model."""
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = c.get("rope_scaling") or (c.get("rope_parameters") or {})
        if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
            scaling = None
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            max_position_embeddings=c.get("max_position_embeddings", 8192),
            rope_theta=float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            rope_scaling=dict(scaling) if scaling else None,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def num_params(self) -> int:
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2
        mlp = 3 * h * f
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + emb + head + h


_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

SHAPES: dict[str, LlamaArch] = {
    # a few-MB shape for fast tests
    "tiny": LlamaArch(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
                      eos_token_ids=(2,), bos_token_id=1),
    "smollm2-135m": LlamaArch(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                              max_position_embeddings=8192, rope_theta=100000.0,
                              tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1),
    "llama3-1b": LlamaArch(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                           max_position_embeddings=131072, rope_theta=500000.0,
                           tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0),
                           eos_token_ids=(128001,), bos_token_id=128000),
    "llama3-8b": LlamaArch(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           max_position_embeddings=131072, rope_theta=500000.0,
                           rope_scaling=dict(_LLAMA3_SCALING), eos_token_ids=(128001,),
                           bos_token_id=128000),
    "llama3-70b": LlamaArch(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                            num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=131072, rope_theta=500000.0,
                            rope_scaling=dict(_LLAMA3_SCALING), eos_token_ids=(128001,),
                            bos_token_id=128000),
}


def named_shape(name: str, num_layers: int | None = None) -> LlamaArch:
    arch = SHAPES[name]
    return replace(arch, num_layers=num_layers) if num_layers else arch
