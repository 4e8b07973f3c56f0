"""twophase: an LLM inference engine that treats prefill and decode as two workloads."""

from __future__ import annotations

from typing import Any

from twophase.backends.hookspecs import hookimpl

__all__ = ["LLM", "PoolingParams", "RequestOutput", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # torch is imported only when the API is used, so the CLI reports config errors at once
    if name in ("LLM", "RequestOutput"):
        from twophase import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from twophase.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from twophase.core.pooling import PoolingParams

        return PoolingParams
    raise AttributeError(name)
