"""The conformance kit: a pytest plugin that checks any backend against the torch reference.

    pytest -p twophase.testing --pyargs twophase.testing --backend NAME [--backend-device cpu]
        [--backend-options '{"key": value}']

``-p`` registers this plugin (its ``--backend`` option); ``--pyargs twophase.testing`` collects
the kit's tests from the installed package, so the command works from any directory. It checks
prefill and decode logits against the torch backend on random shapes, the K/V written into the
pool (at the batch's slots and nowhere else), chunked prefill after cached tokens, batches of
unequal lengths, mixed batches when the backend declares them, its capability declarations, and
greedy tokens on the default model.
"""

from __future__ import annotations

import logging

import pytest

log = logging.getLogger("twophase.testing")
NEAR_TIE = 1e-4


def pytest_addoption(parser) -> None:
    group = parser.getgroup("twophase", "twophase backend conformance")
    group.addoption("--backend", help="the backend to check (a name `twophase backends` lists)")
    group.addoption("--backend-device", default="cpu", help="its device (default: cpu)")
    group.addoption("--backend-options", default="{}",
                    help="its [backend.options] as a JSON object (default: {})")
    group.addoption("--skip-default-model", action="store_true",
                    help="skip the greedy-token check on the default model (it downloads once)")


@pytest.fixture(scope="session")
def backend_device(request) -> str:
    return request.config.getoption("--backend-device", default="cpu")


@pytest.fixture(scope="session")
def backend_options(request) -> dict:
    import json

    text = request.config.getoption("--backend-options", default="{}")
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"--backend-options is not JSON ({exc}): {text!r}") from None
    if not isinstance(options, dict):
        raise pytest.UsageError(f"--backend-options must be a JSON object, not {text!r}")
    return options


@pytest.fixture(scope="session")
def backend_name(request, backend_device) -> str:
    """The backend under test; every check is skipped, with the reason, where it cannot run."""
    from twophase.backends.registry import Registry

    name = request.config.getoption("--backend", default=None)
    if not name:
        pytest.skip("the conformance kit needs --backend NAME")
    reg = Registry()
    if name not in reg.backends:
        failed = [f"{i.source}: {i.error}" for i in reg.failures if i.name == name]
        raise pytest.UsageError(f"no backend named {name!r} is installed"
                                + (f" ({'; '.join(failed)})" if failed else "")
                                + f"; installed: {', '.join(sorted(reg.backends))}")
    why = reg.availability(name, backend_device)
    if why:
        pytest.skip(f"{name} cannot run on {backend_device} here: {why}")
    return name


def assert_greedy_match(ours: list[int], ref: list[int], ref_gaps: list[float], what: str,
                        tie: float = NEAR_TIE) -> None:
    """Tokens must match up to the first step where the reference's top-2 logit gap is below
    ``tie`` (a near-tie: either token is a correct greedy choice); a divergence there passes."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            if ref_gaps[i] < tie:
                log.warning("%s: diverged at token %d on a near-tie (gap %.2e)", what, i, ref_gaps[i])
                return
            raise AssertionError(f"{what}: token {i} is {a}, reference {b} (top-2 gap "
                                 f"{ref_gaps[i]:.3g}); ours {ours}, reference {ref}")
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs reference {len(ref)}"


def logprob_gaps(output) -> list[float]:
    """Top-2 gaps per generated token, from an output sampled with ``logprobs >= 2``."""
    tops = [sorted(lp.values(), reverse=True) for lp in output.logprobs]
    return [a - b for a, b, *_ in tops]
