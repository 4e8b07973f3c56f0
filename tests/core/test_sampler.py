"""The greedy fast path's argmax against torch's own, ties and views included."""

from __future__ import annotations

import torch

from twophase.core.sampler import argmax_rows


def test_argmax_rows_is_torchs_first_largest_on_views_ties_and_other_dtypes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4099, generator=g)
    x[1, [7, 300, 4000]] = 50.0                  # a tie: the first index wins, as in torch
    x[3, :] = 0.0                                # all equal: index 0
    view = x[:, 1:]                              # not contiguous, an offset start
    for rows in (x, view, x[::2], x.to(torch.bfloat16)):
        assert argmax_rows(rows) == rows.argmax(dim=-1).tolist()
    assert argmax_rows(x)[1] == 7 and argmax_rows(x)[3] == 0
