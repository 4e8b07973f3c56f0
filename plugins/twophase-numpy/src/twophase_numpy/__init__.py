"""The ``numpy`` backend: registers through the ``twophase.backends`` entry point."""

from __future__ import annotations

from twophase.backends.hookspecs import hookimpl

from twophase_numpy.backend import NumpyBackend

__all__ = ["NumpyBackend"]


@hookimpl
def twophase_backends():
    return [NumpyBackend]
