"""twophase: an LLM inference engine that treats prefill and decode as two workloads."""

from twophase.backends.hookspecs import hookimpl
from twophase.core.params import SamplingParams
from twophase.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"
