"""Each built-in backend names the architecture features it computes, one by one: a feature added
to ``twophase.arch.FEATURES`` tomorrow is refused by every backend, by its name, until one of them
computes it and says so (a claim derived from the list would compute another model, silently)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import twophase
from twophase.arch import FEATURES, ModelArch, uniform_layers

# the built-in backends, as the package's entry points name them
BUILTIN = {"torch": "twophase.backends.torch_eager:TorchBackend",
           "onnxruntime": "twophase.backends.onnxruntime:OnnxRuntimeBackend",
           "iree": "twophase.backends.iree:IreeBackend",
           "tensorrt": "twophase.backends.tensorrt:TensorRTBackend",
           "native": "twophase.backends.native:NativeBackend"}
MADE_UP, MADE_UP_NAME = "made_up", "a made-up feature"


class MadeUpArch(ModelArch):
    """An architecture that uses the made-up feature besides its own."""

    def features(self) -> frozenset[str]:
        return super().features() | {MADE_UP}


def _arch(cls: type[ModelArch] = MadeUpArch) -> ModelArch:
    """A small Llama every built-in backend computes (native's tiles included)."""
    return cls(family="llama", vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
               layers=uniform_layers(2, 128))


def _backend(name: str):
    module, cls = BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def _answers() -> dict[str, list]:
    """Each built-in backend's answer to the model with the made-up feature: ``supports``,
    ``supports_weights`` on each of its weight formats and ``supports_phase`` in each phase, and
    its claim."""
    out = {}
    for name in BUILTIN:
        b = _backend(name)
        out[name] = [b.supports(_arch()), [b.supports_weights(_arch(), q) for q in b.quantizations]
                     + [b.supports_phase(_arch(), "none", p) for p in ("prefill", "decode")],
                     sorted(b.capabilities().features)]
    return out


def _check(answers: dict[str, list]) -> None:
    for name, (why, weights, claim) in answers.items():
        assert MADE_UP not in claim, f"{name} claims a feature it was never told of"
        assert why == f"{name}: {MADE_UP_NAME} is not implemented", (name, why)
        assert all(w == why for w in weights), (name, weights)


def test_the_built_in_backends_are_these():
    from twophase.backends.registry import Registry

    built_in = {n for n, info in Registry().backends.items() if info.source == "built-in"}
    assert built_in == set(BUILTIN)


def test_a_feature_added_to_the_architecture_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(FEATURES, MADE_UP, MADE_UP_NAME)
    for name in BUILTIN:
        assert _backend(name).supports(_arch(ModelArch)) is None, name     # the model is otherwise computed
    _check(_answers())


def test_a_feature_added_before_the_backends_import_is_refused_by_name():
    """The same with the feature in ``FEATURES`` before any backend module imports: a claim built
    from the list when its module loads would take it in."""
    script = (f"import json, twophase.arch as a; a.FEATURES[{MADE_UP!r}] = {MADE_UP_NAME!r}; "
              f"import {Path(__file__).stem} as t; print(json.dumps(t._answers()))")
    path = os.pathsep.join([str(Path(twophase.__file__).parent.parent), str(Path(__file__).parent),
                            os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(answers) == set(BUILTIN)
    _check(answers)


def test_each_claim_is_a_set_of_known_features():
    for name in BUILTIN:
        caps = _backend(name).capabilities()
        assert caps.features <= set(FEATURES), (name, caps.features - set(FEATURES))
        for quantization, on in caps.features_on.items():
            assert on <= caps.features, (name, quantization)
        for phase, on in caps.features_in.items():
            assert phase in ("prefill", "decode") and on <= caps.features, (name, phase)
