"""Shared fixtures: the default model (ours and HF's reference) and the tiny random shape."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings


from twophase import LLM
from twophase.testing import assert_greedy_match  # noqa: F401  (the kit's near-tie rule)


# CI replays the same examples every run (a landing must not depend on luck); locally every run
# explores new ones
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# One short prompt list for every test on the default model (CI time).
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("raw", "The quick brown fox"),
    ("raw", "def fibonacci(n):"),
]
GREEDY_TOKENS = 32


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    return LLM.from_config({"model": {"name": "smollm2-135m-instruct"},
                            "cache": {"num_blocks": 512}})


@pytest.fixture(scope="session")
def default_prompts(default_llm) -> list[str]:
    return [default_llm.apply_chat_template(p) if kind == "chat" else p for kind, p in PROMPTS]


def tiny_llm(**sections) -> LLM:
    cfg = {"model": {"name": "tiny", "weights": "random"}, "cache": {"num_blocks": 64}}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return LLM.from_config(cfg)


def top2_gaps(logits: torch.Tensor) -> list[float]:
    top = logits.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).tolist()
