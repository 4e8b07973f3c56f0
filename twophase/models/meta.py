"""Building a model on the meta device: shapes and names without memory or initialisation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_init() -> Iterator[None]:
    """Modules built without their default initialisation: on the meta device it computes
    nothing, yet its first call imports ``torch._dynamo`` (3-11 s of a load on a Zen 3 core);
    whoever builds the model assigns or draws every parameter afterwards."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)
