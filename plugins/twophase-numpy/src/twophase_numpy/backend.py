"""The backend: twophase's contract around ``NumpyLlama``. Torch appears only at the boundary
(the batch's index tensors in, logits out, the pool viewed as a NumPy array)."""

from __future__ import annotations

import numpy as np
import torch

from twophase.contract import (Backend, BackendConfig, BackendUnavailable, Capabilities,
                                    DecodeBatch, KVCache, KVCacheSpec, ModelSpec, PrefillBatch)
from twophase.errors import ConfigError

from twophase_numpy.model import NumpyLlama


def numpy_weights(model: ModelSpec) -> dict[str, np.ndarray]:
    """The model's weights as float32 arrays, from the contract's ``model.state_dict()`` (HF
    Llama names; random weights are the torch reference's own numbers)."""
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
         "lm_head": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    for i in range(model.arch.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        w[p + "attn_norm"] = sd[hf + "input_layernorm.weight"]
        w[p + "mlp_norm"] = sd[hf + "post_attention_layernorm.weight"]
        for ours, theirs in names.items():
            w[p + ours] = sd[f"{hf}{theirs}.weight"]
            if f"{hf}{theirs}.bias" in sd:
                w[p + ours + "_bias"] = sd[f"{hf}{theirs}.bias"]
    return w


class NumpyBackend(Backend):
    name = "numpy"
    # the plugin contract this class is written for (twophase.contract.CONTRACT_VERSION): a
    # twophase that does not know it refuses the backend when it discovers it, saying why
    contract_version = 2

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        if device != "cpu":
            raise BackendUnavailable(f"the numpy backend runs on cpu only, not {device!r}")

    def capabilities(self) -> Capabilities:
        # the plain Llama block only: a model with any architecture feature is refused by name
        return Capabilities(devices=("cpu",), dtypes=(torch.float32,), features=frozenset())

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(set())
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the numpy backend computes in float32, not {model.dtype}")
        self.arch = model.arch
        self.model = NumpyLlama(model.arch, numpy_weights(model))

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, torch.float32,
                           torch.device("cpu"))

    def bind_kv_cache(self, kv: KVCache) -> None:
        if kv.pool.dtype != torch.float32 or kv.pool.device.type != "cpu":
            raise ConfigError("cache.dtype", "the numpy backend needs a float32 pool on the cpu")
        self.pool = kv.pool.numpy()              # a view: writes land in the engine's pool

    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        first = batch.query_start
        tables = batch.block_tables.numpy()
        seqs = [(first[i], n, batch.start_positions[i], tables[i])
                for i, n in enumerate(batch.query_lens)]
        hidden = self.model.forward(batch.token_ids.numpy(), batch.positions.numpy(),
                                    batch.slot_mapping.numpy(), seqs, self.pool)
        rows = hidden if batch.logits == "all" else hidden[[first[i + 1] - 1 for i in range(batch.num_seqs)]]
        return torch.from_numpy(np.ascontiguousarray(self.model.logits(rows), dtype=np.float32))

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        return self.prefill(batch.as_prefill())
