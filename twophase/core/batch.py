"""A scheduled step turned into the backend's batch types: which tokens run, where each token's
K/V goes in the pool (its slot), and which blocks each sequence reads (its block table).

Public: the conformance kit, quality measurements and tests build batches with these functions,
exactly as the engine does. Reads request and KV state; writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from twophase.backends.base import DecodeBatch, PrefillBatch
from twophase.core.kv_manager import KVManager
from twophase.core.request import Request
from twophase.core.scheduler import SchedulerOutput

Chunk = tuple[Request, int, int]        # (request, first position, number of tokens)


@dataclass
class StepBatches:
    """One step's backend calls. ``rows[i]`` is the sequence (and its token count) behind row
    ``i`` of the step's logits: the prefill call's rows first, then the decode call's."""

    prefill: PrefillBatch | None
    decode: DecodeBatch | None
    rows: list[tuple[Request, int]]


def build(out: SchedulerOutput, kv: KVManager, one_call: bool) -> StepBatches:
    """The calls for ``out``: with ``one_call`` (one backend serves both phases and takes mixed
    batches) a step with any prefill is ONE ``PrefillBatch`` carrying the decodes as one-token
    chunks; otherwise the chunks go in a ``PrefillBatch`` and the decodes in a ``DecodeBatch``."""
    chunks = [(r, r.num_computed_tokens, n) for r, n in out.prefills]
    decodes = [(r, r.num_computed_tokens, 1) for r in out.decodes]
    if one_call and chunks:
        items = decodes + chunks
        return StepBatches(prefill_batch(items, kv), None, [(r, n) for r, _, n in items])
    return StepBatches(prefill_batch(chunks, kv) if chunks else None,
                       decode_batch(out.decodes, kv) if decodes else None,
                       [(r, n) for r, _, n in chunks] + [(r, 1) for r in out.decodes])


def slots(kv: KVManager, req: Request, start: int, n: int) -> list[int]:
    """Pool slots of ``req``'s positions ``start .. start + n - 1``."""
    table, bs = kv.block_table(req), kv.block_size
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


def block_tables(kv: KVManager, reqs: Sequence[Request]) -> torch.Tensor:
    """``[len(reqs), widest table]`` block ids, padded with 0."""
    tables = [kv.block_table(r) for r in reqs]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def prefill_batch(items: Sequence[Chunk], kv: KVManager) -> PrefillBatch:
    """Chunks ``(request, start, n)``: each request's tokens ``start .. start + n - 1``."""
    tokens: list[int] = []
    positions: list[int] = []
    slot_ids: list[int] = []
    for req, start, n in items:
        tokens += req.token_ids[start:start + n]
        positions += range(start, start + n)
        slot_ids += slots(kv, req, start, n)
    return PrefillBatch(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slot_ids, dtype=torch.long),
        block_tables=block_tables(kv, [r for r, _, _ in items]),
        context_lens=torch.tensor([s + n for _, s, n in items], dtype=torch.long),
        query_lens=[n for _, _, n in items],
        start_positions=[s for _, s, _ in items])


def decode_batch(reqs: Sequence[Request], kv: KVManager) -> DecodeBatch:
    """Each request's next uncomputed token (its position is ``num_computed_tokens``)."""
    pos = [r.num_computed_tokens for r in reqs]
    return DecodeBatch(
        token_ids=torch.tensor([r.token_ids[p] for r, p in zip(reqs, pos)], dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        slot_mapping=torch.tensor([slots(kv, r, p, 1)[0] for r, p in zip(reqs, pos)],
                                  dtype=torch.long),
        block_tables=block_tables(kv, reqs),
        context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long))
