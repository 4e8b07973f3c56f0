"""A backend that does not compute a model's architecture refuses it by the feature's name,
before anything loads or exports; ``auto`` leaves it out with the same reason."""

from __future__ import annotations

import pytest
from helpers.hf_models import tiny_hf_model

from twophase import LLM
from twophase.backends.registry import Registry
from twophase.config import load_config
from twophase.errors import BackendUnavailable, ConfigError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for family in ("qwen3", "mixtral", "gpt_oss", "deepseek_v3"):
        out[family] = tmp_path_factory.mktemp(family)
        tiny_hf_model(family, out[family])
    return out


def _cfg(folder, backend: str, quantization: str = "none") -> dict:
    return {"model": {"path": str(folder), "quantization": quantization}, "cache": {"num_blocks": 32},
            "backend": {"name": backend}}


def test_a_run_on_a_backend_without_the_feature_names_it(folders):
    with pytest.raises(BackendUnavailable, match="native: mixture-of-experts MLPs on 'q4' weights are not implemented"):
        LLM.from_config(_cfg(folders["mixtral"], "native", "q4"))
    with pytest.raises(BackendUnavailable, match="onnxruntime: mixture-of-experts MLPs on 'q4' weights are not"):
        LLM.from_config(_cfg(folders["mixtral"], "onnxruntime", "q4"))
    with pytest.raises(BackendUnavailable, match=r"native: multi-head latent attention .* and DeepSeek's "
                                                 r"expert routing .* are not implemented"):
        LLM.from_config(_cfg(folders["deepseek_v3"], "native"))


def test_each_phase_is_asked(folders):
    cfg = _cfg(folders["deepseek_v3"], "torch")
    cfg["backend"] = {"prefill": {"name": "torch"}, "decode": {"name": "native"}}
    with pytest.raises(BackendUnavailable, match="native: multi-head latent attention"):
        LLM.from_config(cfg)


def test_auto_leaves_out_a_backend_that_refuses_the_model(folders):
    from twophase.builder import routing

    config = load_config(_cfg(folders["gpt_oss"], "auto"))
    chosen, left_out = routing.candidates(config, Registry())
    assert {"torch", "onnxruntime"} <= set(chosen), left_out      # experts and sinks in the graph too
    config = load_config(_cfg(folders["mixtral"], "auto", "q4"))      # experts: native runs them from GGUF only
    with pytest.raises(ConfigError, match="native: mixture-of-experts MLPs on 'q4' weights are not implemented"):
        routing.candidates(config, Registry())
    config = load_config(_cfg(folders["qwen3"], "auto", "q4"))
    chosen, left_out = routing.candidates(config, Registry())
    assert {"native", "onnxruntime"} <= set(chosen), left_out
