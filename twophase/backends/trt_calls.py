"""A step cut into TensorRT calls that each fit one profile (a *rung*:
``twophase.exporters.trt_profiles``).

A sequence's chunk is cut into pieces no longer than the rung for its cached context allows;
the pieces of one sequence run in successive rounds, since a piece attends to the K/V its
predecessor wrote into the pool. In each round the pieces are grouped by rung and packed into
calls of at most the rung's rows and tokens. Sequences are independent within a step, so any
grouping computes the same logits as one call would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twophase.contract import PrefillBatch
from twophase.exporters.trt_profiles import Rung

Piece = tuple[int, int, int]        # (sequence, first token within its chunk, tokens)


@dataclass
class Call:
    rung: int                                          # index into the rungs
    pieces: list[Piece] = field(default_factory=list)


def _rung_for(rungs: list[Rung], phase: str, blocks: int, length: int) -> int:
    """The rung of ``phase`` for a piece after ``blocks`` cached blocks with ``length`` tokens
    to go: the narrowest context that covers it, then one that takes the rest whole with the
    most rows, else the longest chunk."""
    fits = [i for i, r in enumerate(rungs) if r.phase == phase and r.blocks >= blocks]
    if not fits:
        raise ValueError(f"no {phase} profile covers {blocks} cached blocks")
    narrowest = min(rungs[i].blocks for i in fits)
    fits = [i for i in fits if rungs[i].blocks == narrowest]
    return max(fits, key=lambda i: (rungs[i].chunk >= length, rungs[i].rows if rungs[i].chunk >= length
                                                                else rungs[i].chunk))


def pieces_of(rungs: list[Rung], start: int, length: int, block_size: int) -> list[tuple[int, int, int]]:
    """One sequence's chunk as ``(rung, first token, tokens)`` pieces, in order. A one-token
    chunk is a decode."""
    out, offset = [], 0
    while offset < length:
        blocks = -(-(start + offset) // block_size)
        rung = _rung_for(rungs, "decode" if length == 1 else "prefill", blocks, length - offset)
        n = min(length - offset, rungs[rung].chunk)
        out.append((rung, offset, n))
        offset += n
    return out


def plan_calls(rungs: list[Rung], starts: list[int], lens: list[int], block_size: int) -> list[Call]:
    """The calls that compute a step of chunks ``lens`` after ``starts`` cached tokens, in the
    order they must run."""
    per_seq = [pieces_of(rungs, s, n, block_size) for s, n in zip(starts, lens)]
    calls: list[Call] = []
    for k in range(max(map(len, per_seq), default=0)):
        open_calls: dict[int, Call] = {}
        for seq, pieces in enumerate(per_seq):
            if k >= len(pieces):
                continue
            rung, offset, n = pieces[k]
            call = open_calls.get(rung)
            r = rungs[rung]
            if call is None or len(call.pieces) == r.rows or sum(p[2] for p in call.pieces) + n > r.tokens:
                call = open_calls[rung] = Call(rung)
                calls.append(call)
            call.pieces.append((seq, offset, n))
    return calls


def sub_batch(batch: PrefillBatch, pieces: list[Piece]) -> tuple[PrefillBatch, torch.Tensor]:
    """The pieces as a batch of their own, and the rows of ``batch``'s packed tokens they hold."""
    first = batch.query_start
    idx = torch.cat([torch.arange(first[s] + o, first[s] + o + n) for s, o, n in pieces])
    seqs = torch.tensor([s for s, _, _ in pieces], dtype=torch.long)
    starts = [batch.start_positions[s] + o for s, o, _ in pieces]
    lens = [n for _, _, n in pieces]
    context = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.long)
    return PrefillBatch(batch.token_ids[idx], batch.positions[idx], batch.slot_mapping[..., idx],
                        batch.block_tables[..., seqs, :], context, lens, starts, batch.logits), idx


def last_rows(batch: PrefillBatch, pieces: list[Piece]) -> tuple[list[int], list[int]]:
    """For ``logits = "last"``: which of a call's rows end a sequence's chunk, and which
    sequence each ends."""
    rows, seqs = [], []
    for j, (s, o, n) in enumerate(pieces):
        if o + n == batch.query_lens[s]:
            rows.append(j)
            seqs.append(s)
    return rows, seqs
