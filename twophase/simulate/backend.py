"""A backend that computes nothing: each call advances a virtual clock by what the step would
take on the simulated device (``cost.py``) and returns logits whose argmax is a fixed token
that is no end-of-sequence token, so each request's length is its ``max_tokens`` (requests are
sent with ``ignore_eos``). It implements the whole backend contract, so the engine's own
scheduler, KV manager, admission, chunked prefill and preemption run over it unchanged."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from twophase.arch import FEATURES
from twophase.contract import (
    Backend,
    BackendConfig,
    Capabilities,
    DecodeBatch,
    KVCache,
    KVCacheSpec,
    ModelSpec,
    PrefillBatch,
)
from twophase.simulate.clock import VirtualClock
from twophase.simulate.cost import StepCost, StepCostModel
from twophase.simulate.devices import device_spec

OPTIONS = {"device"}


@dataclass(frozen=True)
class Call:
    """One backend call as the simulation saw it."""

    start: float
    kind: str                                 # "prefill" (chunks, maybe with decodes) or "decode"
    chunks: tuple[tuple[int, int], ...]       # (tokens, cached before them) a sequence
    cost: StepCost


def mirrored(caps: Capabilities) -> Capabilities:
    """Another backend's capabilities (its batching, limits, pool layout) on any device."""
    return replace(caps, devices=("cpu", "cuda"), dtypes=(torch.float32, torch.bfloat16, torch.float16),
                   features=frozenset(FEATURES), own_threads=False, max_pool_elements=None)


class SimulatedBackend(Backend):
    name = "simulated"
    quantizations = ("none", "q4")

    def __init__(self, cost: StepCostModel | None = None, clock: VirtualClock | None = None,
                 capabilities: Capabilities | None = None):
        self.cost = cost
        self.clock = clock or VirtualClock()
        self.caps = capabilities or mirrored(Capabilities())
        self.calls: list[Call] = []
        self._logits: torch.Tensor | None = None

    def capabilities(self) -> Capabilities:
        return self.caps

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        """Only the shapes: no weights are read. Without a cost model (loaded by name from a
        registry) it simulates ``options.device`` (default ``h100-80gb``)."""
        cfg.check_options(OPTIONS)
        self.arch, self.dtype = model.arch, model.dtype
        if self.cost is None:
            dtype = str(model.dtype).removeprefix("torch.")
            device = device_spec(str(cfg.options.get("device", "h100-80gb")), dtype)
            kv = torch.empty((), dtype=model.dtype).element_size()
            weights = "q4" if model.quantization == "q4" else dtype
            self.cost = StepCostModel(model.arch, device, weights, kv)
        eos = set(model.arch.eos_token_ids)
        self.token = next(t for t in range(model.arch.vocab_size - 1) if t not in eos)
        row = torch.zeros(1, self.token + 2)           # narrow: argmax needs no full vocabulary
        row[0, self.token] = 1.0                       # (token + 1 is a draft it rejects)
        self._logits = row

    def kv_cache_spec(self) -> KVCacheSpec:
        from twophase.cache.layout import KVHeads

        kv = KVHeads.of(self.arch)          # heads' K and V, or one latent
        return KVCacheSpec(self.arch.num_layers, kv.num_kv_heads, kv.head_dim, self.dtype, torch.device("meta"),
                           planes=kv.planes)

    def bind_kv_cache(self, kv: KVCache) -> None:
        self.kv = kv                                    # never read: nothing is computed

    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        rows = batch.num_seqs if batch.logits == "last" else batch.num_tokens
        return self._run("prefill", tuple(zip(batch.query_lens, batch.start_positions)), rows)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        chunks = tuple((1, int(n) - 1) for n in batch.context_lens.tolist())
        return self._run("decode", chunks, batch.num_seqs)

    def _run(self, kind: str, chunks: tuple[tuple[int, int], ...], rows: int) -> torch.Tensor:
        assert self.cost is not None and self._logits is not None, "load() first"
        cost = self.cost.step(chunks)
        self.calls.append(Call(self.clock(), kind, chunks, cost))
        self.clock.advance(cost.seconds)
        return self._logits.expand(rows, -1)
