"""A step's token masks: computed for every constrained row at once, in a worker thread while
the forward pass runs (llguidance releases the GIL), and applied to the logits in the sampler's
one logits-processing point."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from twophase.core.request import Request
    from twophase.core.scheduler import SchedulerOutput

StepMasks = Mapping[str, np.ndarray]          # request id -> [rows, words] int32 bitmasks

POOL = ThreadPoolExecutor(1, thread_name_prefix="twophase-masks")    # its thread starts on first use


def start(out: SchedulerOutput) -> Future[StepMasks] | None:
    """Begin computing the masks of the rows this step samples; None if no row is constrained."""
    # the rows the sampler samples (a prompt's last chunk, a decode, a decode's drafts)
    wanted = [(req, out.drafts[req.request_id].token_ids if req.request_id in out.drafts else ())
              for req, n in out.scheduled if req.constraint is not None and (
                  req.request_id in out.drafts or req.num_computed_tokens + n == req.num_tokens)]
    if not wanted:
        return None
    return POOL.submit(_compute, wanted)


def _compute(wanted: list[tuple[Request, list[int] | tuple]]) -> StepMasks:
    return {req.request_id: req.constraint.masks(drafts) for req, drafts in wanted}  # type: ignore[union-attr]


def apply(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """``logits [rows, vocab]`` with every token a mask row forbids at -inf (a new tensor)."""
    allowed = np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[-1]]
    keep = torch.from_numpy(allowed.astype(bool)).to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))
