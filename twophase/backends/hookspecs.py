"""The one plugin hook. A plugin module marks a function with ``twophase.hookimpl``."""

from __future__ import annotations

import pluggy

PROJECT = "twophase"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def twophase_backends() -> list[type]:
    """Return the ``Backend`` subclasses this plugin provides, each declaring the contract
    version it is written for (``contract_version``; see ``twophase.contract.CONTRACT_VERSION``)."""
