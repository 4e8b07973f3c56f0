"""The conformance kit: a pytest plugin that checks any backend against the torch reference.

    pytest -p twophase.testing --pyargs twophase.testing --backend NAME [--backend-device cpu]
        [--backend-options '{"key": value}']

``-p`` registers this plugin (its ``--backend`` option); ``--pyargs twophase.testing`` collects
the kit's tests from the installed package, so the command works from any directory. It checks
prefill and decode logits against the torch backend on random shapes, the K/V written into the
pool (at the batch's slots and nowhere else), chunked prefill after cached tokens, batches of
unequal lengths, mixed batches when the backend declares them, its capability declarations, and
greedy tokens on the default model, and that it declares a plugin contract version this twophase
supports.

``--quantization q4`` checks a backend on 4-bit weights that rounds activations to int8 (as
``native`` and onnxruntime's ``accuracy_level`` 4 do), which can never meet 1e-4: its logits are
compared with torch's on the same weights dequantised by their KL divergence and top-1 agreement,
the K/V it writes within 5%, the blocks it must not touch exactly; its tokens under chunking and
preemption with its own on a pool that never preempts; and on the default model its KL from the
float model and greedy agreement (see ``Tolerance``).
"""

from __future__ import annotations

import logging

import pytest

log = logging.getLogger("twophase.testing")
NEAR_TIE = 1e-4


class Tolerance:
    """The bounds of the int8-activation mode, with the margins they leave over the built-in
    q4 backends as measured (the kit's tests print each figure)."""

    # mean KL(torch on the dequantised weights ‖ backend) on the tiny model: measured 2e-7 to
    # 6e-7 for native, 3e-5 when torch runs the float weights instead (the bound sees that)
    KL = 1e-5
    TOP1 = 0.95          # top-1 agreement where torch's top-2 gap exceeds GAP
    GAP = 1e-3
    KV = 5e-2            # K/V written, relative to the pool's largest
    MODEL_KL = 5e-3      # the default model against its float32 self (the project's quality bar)
    MODEL_AGREE = 0.85   # greedy agreement there, teacher-forced


def pytest_addoption(parser) -> None:
    group = parser.getgroup("twophase", "twophase backend conformance")
    group.addoption("--backend", help="the backend to check (a name `twophase backends` lists)")
    group.addoption("--backend-device", default="cpu", help="its device (default: cpu)")
    group.addoption("--backend-options", default="{}",
                    help="its [backend.options] as a JSON object (default: {})")
    group.addoption("--quantization", default="none", choices=["none", "q4"],
                    help="the weights the backend runs (q4: compared within Tolerance, not 1e-4)")
    group.addoption("--skip-default-model", action="store_true",
                    help="skip the greedy-token check on the default model (it downloads once)")


@pytest.fixture(scope="session")
def backend_device(request) -> str:
    return request.config.getoption("--backend-device", default="cpu")


@pytest.fixture(scope="session")
def quantization(request) -> str:
    return request.config.getoption("--quantization", default="none")


def dequantised(llm) -> None:
    """Replace, in place, every projection and the head of ``llm``'s torch model by its q4 form
    dequantised: what a q4 backend computes, but for the rounding of its activations."""
    import torch

    from twophase.models.q4_weights import model_qweights

    model = llm.prefill_backend.model
    weights = model_qweights(model, model.arch, None)
    with torch.no_grad():
        for name, qw in weights.items():
            w = torch.from_numpy(qw.dequantize())
            if name == "lm_head.weight" and model.arch.tie_word_embeddings:
                model.lm_head.weight = torch.nn.Parameter(w)
            else:
                (model.lm_head.weight if name == "lm_head.weight" else model.get_parameter(name)).copy_(w)


def compare_quantised(got, want) -> tuple[float, float, int]:
    """Mean KL(want ‖ got) over rows, top-1 agreement on the rows where ``want``'s top-2 gap
    exceeds ``Tolerance.GAP`` (a near-tie may go either way), and how many rows those are."""
    import torch

    ref, lp = torch.log_softmax(want.float(), -1), torch.log_softmax(got.float(), -1)
    kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
    top2 = want.float().topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > Tolerance.GAP
    agree = float((got.argmax(-1) == want.argmax(-1))[clear].float().mean()) if bool(clear.any()) else 1.0
    return kl, agree, int(clear.sum())


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
def backend_info(request):
    """The registry's entry for the backend under test (``BackendInfo``), whether or not it can
    run here: a backend refused at discovery (a contract version this twophase does not know)
    is still listed, with ``refused`` saying why."""
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
    return reg.backends[name]


@pytest.fixture(scope="session")
def backend_name(backend_info, backend_device) -> str:
    """The backend under test; every check is skipped, with the reason, where it cannot run
    (the contract-version check runs still, and fails for a backend refused at discovery)."""
    from twophase.contract import BackendUnavailable

    name = backend_info.name
    try:
        backend_info.cls.check_available(backend_device)     # a refused one's stand-in says why
    except BackendUnavailable as exc:
        why = str(exc)
    else:
        why = None
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
