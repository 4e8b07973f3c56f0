"""gpt-oss on the native backend from a GGUF as llama.cpp's converter writes it, its experts in
MXFP4 as gpt-oss's files store them: the C step (sinks, biased router and experts, the clamped
SwiGLU, MXFP4 blocks) against torch on the same file dequantised by the ``gguf`` package."""

from __future__ import annotations

import pytest
from helpers.gguf_writer import write_gguf
from helpers.hf_models import tiny_hf_model
from helpers.native import native_or_skip

from twophase import LLM

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mxfp4_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = tiny_hf_model("gpt_oss", folder / "hf")
    layers = model.config.num_hidden_layers
    types = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(layers) for p in ("gate", "up", "down")}
    types |= {f"blk.{i}.attn_{p}.weight": "Q8_0" for i in range(layers) for p in ("q", "k", "v", "output")}
    return write_gguf(folder / "hf", folder / "tiny-gpt-oss-mxfp4.gguf", types)


def test_native_on_mxfp4_experts_gives_the_dequantised_models_logits(mxfp4_file):
    """Equal up to the rounding of the activations (measured 5.5e-3, top-1 1.000; a sink, a bias
    or an FP4 code read wrongly would be off by far more)."""
    from helpers.models import prefill_all_logits

    native_or_skip()
    cache = {"num_blocks": 64, "block_size": 8}
    native = LLM.from_config({"model": {"path": str(mxfp4_file), "quantization": "gguf"},
                              "backend": {"name": "native"}, "cache": cache})
    ref = LLM.from_config({"model": {"path": str(mxfp4_file)}, "backend": {"name": "torch"}, "cache": cache})
    prompts = [[(7 * i + 3 * s) % 290 + 5 for i in range(20 + 9 * s)] for s in range(3)]
    got, want = prefill_all_logits(native, prompts), prefill_all_logits(ref, prompts)
    rel = float((got - want).abs().max() / want.abs().max())
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert rel < 4e-2 and top1 > 0.85, f"logits differ by {rel:.2e} (relative); top-1 agrees at {top1:.2f}"


@pytest.fixture(scope="module")
def experts_only_file(tmp_path_factory):
    """The same tiny gpt-oss with only its experts in MXFP4 (the rest F32, which every path
    computes in float): what differs between two native runs is then the experts' arithmetic."""
    folder = tmp_path_factory.mktemp("gpt_oss_experts")
    model = tiny_hf_model("gpt_oss", folder / "hf")
    types = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(model.config.num_hidden_layers)
             for p in ("gate", "up", "down")}
    return write_gguf(folder / "hf", folder / "tiny-gpt-oss-experts.gguf", types)


def test_experts_on_the_amx_tiles_are_nearer_the_float_model(experts_only_file):
    """Every step on the tiles (``amx = 1``): each expert's routed rows meet its MXFP4 blocks in
    bf16, nearer torch on the dequantised file than the int8 paths' 8-bit activations (measured
    1.6e-3 against 6.7e-3; with the experts kept off the tiles, the two runs are the same)."""
    from helpers.models import prefill_all_logits

    native_or_skip()
    from twophase.backends.native import NativeBackend

    if "AMX" not in (NativeBackend.engines_here() or ""):
        pytest.skip("no AMX tiles on this CPU")
    cache = {"num_blocks": 64, "block_size": 8}
    prompts = [[(7 * i + 3 * s) % 290 + 5 for i in range(20 + 9 * s)] for s in range(3)]
    want = prefill_all_logits(LLM.from_config({"model": {"path": str(experts_only_file)}, "cache": cache}), prompts)
    err = {}
    for amx in (1, False):
        llm = LLM.from_config({"model": {"path": str(experts_only_file), "quantization": "gguf"}, "cache": cache,
                               "backend": {"name": "native", "options": {"amx": amx}}})
        got = prefill_all_logits(llm, prompts)
        err[amx] = float((got - want).abs().max() / want.abs().max())
        llm.close()
    assert err[1] < 0.5 * err[False], err
