"""An integer test backend: no arithmetic worth the name, but a strict user of the KV pool.

Each step writes every new token's id into K and its position + 1 into V at its slot, then reads
every sequence's whole context back *from the pool* through its block table. V must read
1, 2, ..., n: anything else means a wrong block table or slot mapping, or a block that another
sequence overwrote. The next token is ``next_token(context read from the pool)``, so a stale or
foreign K (a bad prefix-cache hit, a reused block) changes the output; tests compare it with
``expected_tokens``, which runs the same function on the request alone. The batch itself is checked
too: no empty chunk (it has no last token to take logits from), no slot written twice in one
call, positions and context lengths consistent with the chunks.

Token ids are ``0 .. VOCAB-1``; ``EOS = 0``. ``next_token`` can return EOS (about one step in
``VOCAB``), so some requests stop early with ``finish_reason == "stop"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
from twophase.core.engine import Engine
from twophase.core.kv_manager import KVManager
from twophase.core.sampling_params import SamplingParams
from twophase.core.scheduler import Scheduler

VOCAB = 97
EOS = 0

__all__ = ["EOS", "VOCAB", "Call", "IntBackend", "expected_tokens", "greedy", "make_engine",
           "next_token"]


def next_token(tokens: list[int]) -> int:
    """A polynomial hash of the whole sequence mod ``VOCAB``: every token, its place and the
    length matter (31 is invertible mod 97, so changing any one token changes the result)."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % VOCAB
    return h


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What a greedy request must generate alone: stops after EOS or ``max_tokens`` tokens."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(seq)
        seq.append(t)
        out.append(t)
        if t == EOS:
            break
    return out


@dataclass
class Call:
    """One backend call, as the engine made it (for budget and batch-size checks)."""

    kind: str                  # "prefill" or "decode"
    num_tokens: int
    num_seqs: int
    query_lens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)


class IntBackend(Backend):
    name = "int-test"

    def __init__(self) -> None:
        self.kv: KVCache | None = None
        self.calls: list[Call] = []

    def capabilities(self) -> Capabilities:
        return Capabilities()

    def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
        """Nothing to load."""

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                           device=torch.device("cpu"))

    def bind_kv_cache(self, kv: KVCache) -> None:
        self.kv = kv

    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        self.calls.append(Call("prefill", batch.num_tokens, batch.num_seqs, list(batch.query_lens),
                               list(batch.start_positions)))
        starts, lens = batch.start_positions, batch.query_lens
        assert all(n >= 1 for n in lens), f"an empty chunk has no last token: query_lens {lens}"
        ctx = batch.context_lens.tolist()
        assert ctx == [s + n for s, n in zip(starts, lens)], (
            f"context_lens {ctx} != start_positions {starts} + query_lens {lens}")
        assert batch.positions.tolist() == [p for s, n in zip(starts, lens)
                                            for p in range(s, s + n)], "positions != chunks"
        if batch.logits == "all":              # a row per token: the context up to each one
            return self._run(batch.token_ids, batch.positions, batch.slot_mapping,
                             batch.block_tables, ctx, [n for n in lens])
        return self._run(batch.token_ids, batch.positions, batch.slot_mapping,
                         batch.block_tables, ctx)

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        ctx = batch.context_lens.tolist()
        self.calls.append(Call("decode", batch.num_seqs, batch.num_seqs, [1] * batch.num_seqs,
                               [n - 1 for n in ctx]))
        assert batch.positions.tolist() == [n - 1 for n in ctx], "decode position != context - 1"
        return self._run(batch.token_ids, batch.positions, batch.slot_mapping,
                         batch.block_tables, ctx)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             tables: torch.Tensor, context_lens: list[int],
             rows_per_seq: list[int] | None = None) -> torch.Tensor:
        assert self.kv is not None, "bind_kv_cache was not called"
        bs, pool = self.kv.block_size, self.kv.pool
        slot_list = slots.tolist()
        assert len(set(slot_list)) == len(slot_list), f"two tokens written to one slot: {slot_list}"
        k, v = pool[0, 0, :, 0, :, 0], pool[0, 1, :, 0, :, 0]       # [num_blocks, block_size]
        b, off = slots // bs, slots % bs
        k[b, off] = tokens.to(pool.dtype)
        v[b, off] = (positions + 1).to(pool.dtype)
        rows: list[torch.Tensor] = []
        for i, n in enumerate(context_lens):
            table = tables[i, :-(-n // bs)]
            assert table.numel() * bs >= n, f"sequence {i}: block table too short for {n} tokens"
            ctx_k = k[table].reshape(-1)[:n]
            ctx_v = v[table].reshape(-1)[:n]
            want = torch.arange(1, n + 1, dtype=pool.dtype)
            if not torch.equal(ctx_v, want):
                bad = int((ctx_v != want).nonzero()[0])
                raise AssertionError(
                    f"sequence {i} (block table {table.tolist()}): position {bad} holds V="
                    f"{ctx_v[bad].item():g}, expected {bad + 1}: wrong table or slot, or a block "
                    f"overwritten by another sequence")
            seq = [int(t) for t in ctx_k.tolist()]
            for m in range(n - (rows_per_seq[i] if rows_per_seq else 1) + 1, n + 1):
                row = torch.zeros(VOCAB)
                row[next_token(seq[:m])] = 1.0
                rows.append(row)
        return torch.stack(rows)


def make_engine(num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                policy: str = "decode-first", chunked_prefill: bool = True,
                prefix_caching: bool = True, max_model_len: int = 256) -> Engine:
    """An Engine over an IntBackend, built from core parts directly (no config, no tokenizer:
    prompts are token-id lists). The pool is zeroed, so V = 0 marks a slot never written."""
    if policy == "decode-first" and chunked_prefill and max_num_batched_tokens <= max_num_seqs:
        raise ValueError("max_num_batched_tokens must exceed max_num_seqs (as LLM enforces)")
    backend = IntBackend()
    spec = backend.kv_cache_spec()
    pool = torch.zeros(spec.num_layers, 2, num_blocks, spec.num_kv_heads, block_size,
                       spec.head_dim, dtype=spec.dtype)
    backend.bind_kv_cache(KVCache(pool, block_size))
    kv = KVManager(num_blocks, block_size, prefix_caching)
    scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens, policy, chunked_prefill,
                          max_model_len=max_model_len, eos_token_ids=(EOS,), vocab_size=VOCAB)
    return Engine(backend, backend, scheduler, vocab_size=VOCAB)


def greedy(max_tokens: int) -> SamplingParams:
    """The only sampling the integer backend's one-hot logits are meant for."""
    return SamplingParams(max_tokens=max_tokens)
