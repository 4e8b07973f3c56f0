"""Runs a step's batches on the backends: phase routing, and the thread policy around them.

One backend serving both phases gets ONE call a step (``batch.build`` folds the decodes into the
prefill chunk, so they ride on the chunk's read of the weights); phases routed to different
backends make two calls, over the same KV pool. Decode may itself be routed by batch size
(``decode_routes``: ``[backend] name = "auto"`` where two backends cross).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from twophase.contract import Backend, DecodeBatch
from twophase.core.batch import StepBatches
from twophase.core.seq_state import Seq

S = TypeVar("S", bound=Seq)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run torch's CPU ops on ``n`` threads inside the block (``None``: as they are)."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Executor:
    def __init__(self, prefill_backend: Backend, decode_backend: Backend,
                 decode_routes: Sequence[tuple[int, Backend]] = ()):
        """``decode_routes``: ``(largest batch, backend)`` in ascending order; a decode of more
        sequences than the last goes to ``decode_backend``."""
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.decode_routes = list(decode_routes)
        self.mixed = prefill_backend.capabilities().mixed_batches
        # where no backend computes with torch, torch only glues a step together: one thread,
        # since an OpenMP team woken for a 49k-logit argmax keeps spinning into the runtime's
        # next call (measured: docs/measurements.md, "Figures behind choices in the code")
        self.glue_threads = 1 if all(b.capabilities().own_threads for b in self.backends()) else None

    def one_call(self, decodes: int) -> bool:
        """Whether a step with ``decodes`` decodes and prefill chunks is one call: its decodes
        go to the prefill's backend, and that backend takes mixed batches."""
        return self.mixed and self.decoder(decodes) is self.prefill_backend

    def decoder(self, sequences: int) -> Backend:
        """The backend that decodes (or verifies) a batch of ``sequences``."""
        for largest, backend in self.decode_routes:
            if sequences <= largest:
                return backend
        return self.decode_backend

    def glue(self) -> contextlib.AbstractContextManager[None]:
        """The thread setting for the step's torch work around the backends' calls."""
        return torch_threads(self.glue_threads)

    def run(self, batches: StepBatches[S]) -> torch.Tensor:
        """Logits, one row per ``batches.rows`` entry's logits rows, in order."""
        parts = []
        for call, batch in batches.calls:
            if isinstance(batch, DecodeBatch):
                parts.append(self.decoder(batch.num_seqs).decode(batch))
            elif call == "prefill":
                parts.append(self.prefill_backend.prefill(batch))
            else:                     # verify: the decode phase's work, a chunk of each decode
                parts.append(self.decoder(batch.num_seqs).prefill(batch))
        if len(parts) == 1:
            return parts[0]
        device = parts[0].device
        return torch.cat([p.float().to(device) for p in parts])

    def backends(self) -> list[Backend]:
        """Each distinct backend once."""
        routed = [b for _, b in self.decode_routes]
        return list({id(b): b for b in (self.prefill_backend, self.decode_backend, *routed)}.values())

    def close(self) -> None:
        for b in self.backends():
            b.close()
