"""A scheduled step turned into the backend's batch types: which tokens run, where each token's
K/V goes in the pool (its slot), and which blocks each sequence reads (its block table).

Public: the conformance kit, quality measurements and tests build batches with these functions,
exactly as the engine does. Reads sequence and KV state (a ``Seq``: a request, or the draft
model's copy of one); writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import torch

from twophase.contract import DecodeBatch, PrefillBatch
from twophase.core.kv_manager import KVManager
from twophase.core.request import Request
from twophase.core.scheduler import SchedulerOutput
from twophase.core.seq_state import Seq

Chunk = tuple[Seq, int, int]        # (sequence, first position, number of tokens)
S = TypeVar("S", bound=Seq)


Call = Literal["prefill", "decode", "verify"]


@dataclass
class StepBatches(Generic[S]):
    """One step's backend calls, in order: ``prefill`` (the prefill backend's ``prefill``),
    ``decode`` (the decode backend's ``decode``), ``verify`` (the decode backend's ``prefill``
    over decodes and their drafts, logits at every position). ``rows[i] = (sequence, tokens
    computed, logits rows)`` says whose rows of the step's logits come next."""

    calls: list[tuple[Call, PrefillBatch | DecodeBatch]]
    rows: list[tuple[S, int, int]]


def build(out: SchedulerOutput, kv: KVManager, one_call: bool) -> StepBatches[Request]:
    """The calls for ``out``: with ``one_call`` (one backend serves both phases and takes mixed
    batches) a step with any prefill is ONE ``PrefillBatch`` carrying the decodes as one-token
    chunks; otherwise the chunks go in a ``PrefillBatch`` and the decodes in a ``DecodeBatch``.
    A step that verifies drafts sends its decodes as chunks (each its token and its drafts) in
    one ``verify`` call. Where a chunk's request asks for its prompt's log-probabilities, the
    call carrying the chunks returns logits at every position (``logits = "all"``)."""
    every = any(r.wants_prompt_logprobs for r, _ in out.prefills)
    steps = (build_phases(out.decodes, out.prefills, kv, one_call, every) if not out.drafts
             else _build_verify(out, kv, every))
    if steps.calls:            # the state copies the KV manager asked for, before anything reads them
        steps.calls[0][1].state_copies = kv.take_copies()
    return steps


def _build_verify(out: SchedulerOutput, kv: KVManager, every: bool) -> StepBatches[Request]:
    chunks = [(r, r.num_computed_tokens, n) for r, n in out.prefills]
    items = [(r, r.num_computed_tokens, out.tokens_of(r)) for r in out.decodes]
    verify = prefill_batch(items, kv, {k: p.token_ids for k, p in out.drafts.items()})
    verify.logits = "all"
    calls: list[tuple[Call, PrefillBatch | DecodeBatch]] = \
        [("prefill", _with_logits(prefill_batch(chunks, kv), every))] if chunks else []
    return StepBatches(calls + [("verify", verify)],
                       [(r, n, n if every else 1) for r, _, n in chunks] + [(r, n, n) for r, _, n in items])


def _with_logits(batch: PrefillBatch, every: bool) -> PrefillBatch:
    if every:
        batch.logits = "all"
    return batch


def build_phases(decodes: Sequence[S], prefills: Sequence[tuple[S, int]], kv: KVManager,
                 one_call: bool, every: bool = False) -> StepBatches[S]:
    """``build`` for a step with no drafts to verify, over any sequences: the draft model's
    steps are built here too, from its own copies of the requests. ``every``: the chunks' call
    returns logits at every position (a chunk's rows are then its tokens')."""
    chunks = [(r, r.num_computed_tokens, n) for r, n in prefills]
    chunk_rows = [(r, n, n if every else 1) for r, _, n in chunks]
    if one_call and chunks:
        items = [(r, r.num_computed_tokens, 1) for r in decodes] + chunks
        return StepBatches([("prefill", _with_logits(prefill_batch(items, kv), every))],
                           [(r, n, n if every else 1) for r, _, n in items])
    calls: list[tuple[Call, PrefillBatch | DecodeBatch]] = \
        [("prefill", _with_logits(prefill_batch(chunks, kv), every))] if chunks else []
    if decodes:
        calls.append(("decode", decode_batch(decodes, kv)))
    return StepBatches(calls, chunk_rows + [(r, 1, 1) for r in decodes])


def _slots(table: list[int], bs: int, start: int, n: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


def _group_slots(kv: KVManager, items: Sequence[tuple[Seq, int, int]]) -> torch.Tensor:
    """``[T]`` slots of each chunk's tokens, or ``[G, T]`` in a pool of several groups."""
    per_group = [[s for r, start, n in items for s in _slots(kv.block_tables(r)[g], kv.block_size, start, n)]
                 for g in range(kv.num_groups)]
    out = torch.tensor(per_group, dtype=torch.long).view(kv.num_groups, -1)
    return out[0] if kv.num_groups == 1 else out


def block_tables(kv: KVManager, reqs: Sequence[Seq]) -> torch.Tensor:
    """``[len(reqs), widest table]`` block ids, padded with 0 (``[G, ...]`` in groups)."""
    tables = [kv.block_tables(r) for r in reqs]
    width = max(len(t[0]) for t in tables)
    out = torch.tensor([[t[g] + [0] * (width - len(t[g])) for t in tables] for g in range(kv.num_groups)],
                       dtype=torch.long)
    return out[0] if kv.num_groups == 1 else out


def state_slots(kv: KVManager, reqs: Sequence[Seq]) -> torch.Tensor | None:
    """``[len(reqs)]`` each sequence's state slot; None where the model keeps no state."""
    if not kv.state_slots:
        return None
    return torch.tensor([kv.state_slot(r) for r in reqs], dtype=torch.long)


def lora_slots(kv: KVManager, reqs: Sequence[Seq]) -> list[int] | None:
    """Each sequence's adapter slot (-1: the base model); None where none has one."""
    if kv.adapters is None:
        return None
    slots = [kv.adapter_slot(r) for r in reqs]
    return slots if any(s >= 0 for s in slots) else None


def prefill_batch(items: Sequence[Chunk], kv: KVManager,
                  drafts: Mapping[str, list[int]] | None = None) -> PrefillBatch:
    """Chunks ``(sequence, start, n)``: each sequence's tokens ``start .. start + n - 1``, where
    those past its own tokens are its ``drafts`` (speculative tokens, by request id)."""
    tokens: list[int] = []
    positions: list[int] = []
    for req, start, n in items:
        own = req.token_ids[start:start + n]
        tokens += own
        if len(own) < n:
            tokens += (drafts or {})[req.request_id][:n - len(own)]
        positions += range(start, start + n)
    return PrefillBatch(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=_group_slots(kv, items),
        block_tables=block_tables(kv, [r for r, _, _ in items]),
        context_lens=torch.tensor([s + n for _, s, n in items], dtype=torch.long),
        query_lens=[n for _, _, n in items],
        start_positions=[s for _, s, _ in items],
        state_slots=state_slots(kv, [r for r, _, _ in items]),
        lora_slots=lora_slots(kv, [r for r, _, _ in items]))


def decode_batch(reqs: Sequence[Seq], kv: KVManager) -> DecodeBatch:
    """Each request's next uncomputed token (its position is ``num_computed_tokens``)."""
    pos = [r.num_computed_tokens for r in reqs]
    return DecodeBatch(
        token_ids=torch.tensor([r.token_ids[p] for r, p in zip(reqs, pos)], dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        slot_mapping=_group_slots(kv, [(r, p, 1) for r, p in zip(reqs, pos)]),
        block_tables=block_tables(kv, reqs),
        context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long),
        state_slots=state_slots(kv, reqs),
        lora_slots=lora_slots(kv, reqs))
