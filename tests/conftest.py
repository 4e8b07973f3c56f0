"""Shared fixtures: the default model (ours and HF's reference) and the tiny random shape."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import PREEMPTING, PROMPTS, random_prompts, tiny_llm
from hypothesis import settings

from twophase import LLM, SamplingParams

# The suite's artefacts (the default model, exports, compiled modules, calibration) go to a
# cache of their own beside the user's, never into it: $TWOPHASE_TEST_CACHE, else
# "<$TWOPHASE_CACHE or ~/.cache/twophase>-tests". Set before any twophase module reads it.
_user_cache = os.environ.get("TWOPHASE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "twophase")
# Named in TWOPHASE_TEST_CACHE too, so test workers (pytest-xdist) that inherit this environment
# take the same folder rather than deriving "<...>-tests-tests" from the changed TWOPHASE_CACHE.
os.environ["TWOPHASE_TEST_CACHE"] = os.environ.get("TWOPHASE_TEST_CACHE") or os.path.normpath(_user_cache) + "-tests"
os.environ["TWOPHASE_CACHE"] = os.environ["TWOPHASE_TEST_CACHE"]

# Under pytest-xdist (the README's ``-n auto``) the workers share the machine's cores: each
# computes on one thread (every backend's default follows torch's), so two workers on two cores
# trace, export and compute side by side instead of fighting over both cores. Tests of
# multi-threaded paths set their threads themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# CI replays the same examples every run (a landing must not depend on luck); locally every run
# explores new ones
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

def pytest_collection_modifyitems(config, items):
    # files that load the default model first: test workers take files in this order, so the
    # long ones start early and the short ones fill the end (stable: an order within each kind)
    slow_files = {i.path for i in items if "slow" in i.keywords}
    items.sort(key=lambda i: i.path not in slow_files)
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
def default_hf_base(default_llm):
    """HF's base model of the default model (``last_hidden_state``: after the final norm), float32."""
    import transformers

    return transformers.AutoModel.from_pretrained(default_llm.model.weights, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_server():
    """The default model behind the real HTTP server (uvicorn on a free port): ``(llm, url, app)``,
    shared by the files that test the server."""
    pytest.importorskip("uvicorn")
    from helpers.server import serving

    llm = LLM.from_config({"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 256}})
    with serving(llm) as (url, app):
        yield llm, url, app


@pytest.fixture(scope="session")
def client(default_server):
    """The real ``openai`` client of ``default_server``."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=default_server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def default_prompts(default_llm) -> list[str]:
    return [default_llm.apply_chat_template(p) if kind == "chat" else p for kind, p in PROMPTS]


@pytest.fixture(scope="session")
def preempting_torch_tokens() -> list[list[int]]:
    """The torch backend's greedy tokens for ``random_prompts()`` under ``PREEMPTING``."""
    return [o.token_ids for o in tiny_llm(**PREEMPTING).generate(
        random_prompts(), SamplingParams(max_tokens=16, ignore_eos=True))]


