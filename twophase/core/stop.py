"""Every token-level stop rule in one pure function (stop *strings* need text: see
``output_processor.py``)."""

from __future__ import annotations

from twophase.core.request import Request


def check_stop(req: Request, max_model_len: int, eos_token_ids: tuple[int, ...]) -> str | None:
    """Why ``req`` ends after its last token: ``"stop"`` (a stop token or EOS, once
    ``min_tokens`` are out, or the end of its grammar), ``"length"`` (``max_tokens`` or the
    context is full), ``"error"`` (its grammar can no longer be followed), or None."""
    p = req.params
    n = req.num_output_tokens
    if n == 0:
        return None
    last = req.token_ids[-1]
    if req.constraint is not None and req.constraint.error is not None:
        return "error"                                 # the grammar broke or grew too slow
    if n >= p.min_tokens and (last in p.stop_token_ids
                              or (not p.ignore_eos and last in eos_token_ids)):
        return "stop"
    if req.constraint is not None and req.constraint.done:
        return "stop"                                  # the grammar is complete
    if n >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
