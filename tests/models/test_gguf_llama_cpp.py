"""gpt-oss GGUF files beside llama.cpp, the reference for what its files mean: the same token
ids through llama.cpp (``llama-cpp-python`` in an interpreter of its own, named by
``TWOPHASE_LLAMA_PYTHON``: it compiles llama.cpp, so the default run leaves it out) and through
twophase's torch and native backends, logits at every position.

The tiny model's RoPE is plain here: llama.cpp rounds YaRN's correction range to whole
dimensions, where gpt-oss's config says not to (``truncate: false``, as OpenAI's reference
computes it, and transformers and twophase with it), so with YaRN the two differ by design
(docs/models.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf_writer import write_gguf
from helpers.hf_models import tiny_hf_model
from helpers.models import prefill_all_logits

from twophase import LLM

PYTHON = os.environ.get("TWOPHASE_LLAMA_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="set TWOPHASE_LLAMA_PYTHON to a Python with llama-cpp-python")
pytest.importorskip("transformers")

LOGITS = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.loads(sys.argv[2])
llm = Llama(model_path=sys.argv[1], logits_all=True, n_ctx=256, n_batch=256, n_threads=2, verbose=False)
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], dtype=np.float32))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_plain_rope")
    tiny_hf_model("gpt_oss", folder / "hf")
    config = json.loads((folder / "hf" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (folder / "hf" / "config.json").write_text(json.dumps(config))
    experts = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(config["num_hidden_layers"])
               for p in ("gate", "up", "down")}
    return {"f32": write_gguf(folder / "hf", folder / "f32.gguf"),
            "mxfp4": write_gguf(folder / "hf", folder / "mxfp4.gguf", experts)}


# llama.cpp keeps K/V in float16 and, on MXFP4 blocks, rounds activations to 8 bits: measured
# 2.8e-4 (F32) and 7e-3 (MXFP4) from both of twophase's backends, top-1 equal at every position
@pytest.mark.parametrize("kind, within", [("f32", 1e-3), ("mxfp4", 2e-2)])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gpt_oss_gguf_gives_llama_cpp_s_logits(files, tmp_path, kind, within, backend):
    """Sinks, the window (24 here: 60 tokens cross it), biases, the clamped SwiGLU, experts."""
    if backend == "native":
        from helpers.native import native_or_skip

        native_or_skip()
    prompt = [(7 * i + 3) % 290 + 5 for i in range(60)]
    assert PYTHON is not None
    subprocess.run([PYTHON, "-c", LOGITS, str(files[kind]), json.dumps(prompt), str(tmp_path / "ref.npy")],
                   check=True, capture_output=True)
    ref = torch.from_numpy(np.load(tmp_path / "ref.npy"))
    model = {"path": str(files[kind]), "quantization": "gguf" if backend == "native" else "none"}
    llm = LLM.from_config({"model": model, "backend": {"name": backend}, "cache": {"num_blocks": 64, "block_size": 8}})
    got = prefill_all_logits(llm, [prompt]).reshape(ref.shape)
    assert float((got - ref).abs().max() / ref.abs().max()) < within
    assert bool((got.argmax(-1) == ref.argmax(-1)).all())


def test_the_writer_s_file_is_one_llama_cpp_reads_as_gpt_oss(files):
    """The helper writes files "as llama.cpp's converter writes them": llama.cpp's loader says
    which architecture it read."""
    assert PYTHON is not None
    out = subprocess.run([PYTHON, "-c", "import sys; from llama_cpp import Llama; "
                          "m = Llama(model_path=sys.argv[1], verbose=False); print(m.metadata['general.architecture'])",
                          str(files["f32"])], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "gpt-oss"
    assert Path(files["mxfp4"]).stat().st_size < Path(files["f32"]).stat().st_size
