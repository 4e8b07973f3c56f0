"""The backend: twophase's contract around ``NumpyLlama``. Torch appears only at the boundary
(the batch's index tensors in, logits out, the pool viewed as a NumPy array)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from twophase.backends.base import (Backend, BackendConfig, BackendUnavailable, Capabilities,
                                    DecodeBatch, KVCache, KVCacheSpec, ModelSpec, PrefillBatch)
from twophase.errors import ConfigError

from twophase_numpy.model import NumpyLlama


def numpy_weights(model: ModelSpec) -> dict[str, np.ndarray]:
    """The model's weights as float32 arrays, loaded once by twophase's own loader."""
    from twophase.models.shapes import LlamaArch
    from twophase.models.weights import build_model

    arch = LlamaArch.from_dict(model.arch)
    folder = None if model.weights == "random" else Path(model.weights)
    sd = {k: v.detach().numpy().copy() for k, v in
          build_model(arch, torch.float32, torch.device("cpu"), folder, model.seed).state_dict().items()}
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    w = {"embed": sd["embed.weight"], "norm": sd["norm.weight"],
         "lm_head": sd.get("lm_head.weight", sd["embed.weight"])}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = sd[p + "attn_norm.weight"]
        w[p + "mlp_norm"] = sd[p + "mlp_norm.weight"]
        for kind in ("weight", "bias"):
            suffix = "" if kind == "weight" else "_bias"
            if p + f"attn.qkv.{kind}" in sd:
                qw, kw, vw = np.split(sd[p + f"attn.qkv.{kind}"], [q, q + kv])
                w[p + "q" + suffix], w[p + "k" + suffix], w[p + "v" + suffix] = qw, kw, vw
            if p + f"attn.o.{kind}" in sd:
                w[p + "o" + suffix] = sd[p + f"attn.o.{kind}"]
            if p + f"mlp.gate_up.{kind}" in sd:
                w[p + "gate" + suffix], w[p + "up" + suffix] = np.split(sd[p + f"mlp.gate_up.{kind}"], 2)
            if p + f"mlp.down.{kind}" in sd:
                w[p + "down" + suffix] = sd[p + f"mlp.down.{kind}"]
    return w


class NumpyBackend(Backend):
    name = "numpy"

    @classmethod
    def check_available(cls, device: str = "cpu") -> None:
        if device != "cpu":
            raise BackendUnavailable(f"the numpy backend runs on cpu only, not {device!r}")

    def capabilities(self) -> Capabilities:
        return Capabilities(devices=("cpu",), dtypes=(torch.float32,))

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        self.check_available(cfg.device)
        cfg.check_options(set())
        if model.dtype != torch.float32:
            raise ConfigError("model.dtype", f"the numpy backend computes in float32, not {model.dtype}")
        self.arch = model.arch
        self.model = NumpyLlama(model.arch, numpy_weights(model))

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(a["num_layers"], a["num_kv_heads"], a["head_dim"], torch.float32,
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
