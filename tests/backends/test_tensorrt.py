"""The tensorrt backend on both sides of the boundary this machine cannot cross: the profile
shapes computed from a config, and the calls the backend makes, against a recording stand-in for
TensorRT that runs the engine's ONNX graph (``fake_tensorrt``). Real TensorRT runs only in the
GPU-marked test."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import fake_tensorrt
from helpers.models import random_prompts, tiny_llm

from twophase import LLM, SamplingParams
from twophase.backends.base import BackendUnavailable, EngineLimits
from twophase.exporters import tensorrt as exporter
from twophase.graph.signature import STEP

pytest.importorskip("onnxruntime")
ARCH = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}


def test_profile_shapes_follow_the_config():
    prefill, decode = exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), block_size=4,
                                              num_blocks=64)
    assert set(prefill) == set(decode) == set(STEP.names)
    # prefill: up to the token budget, chunks up to it, decodes riding along (0..max_num_seqs)
    assert prefill["input_ids"] == ((1,), (48,), (48,))
    assert prefill["chunk_index"] == ((0, 1), (1, 48), (8, 48))
    assert prefill["chunk_tables"] == ((0, 1), (1, 12), (8, 25))      # 100 tokens = 25 blocks
    assert prefill["dec_tables"] == ((0, 1), (0, 12), (8, 25))
    assert prefill["logits_index"] == ((1,), (8,), (48,))
    # decode: one token per sequence, 1..max_num_seqs, no chunk group
    assert decode["input_ids"] == ((1,), (8,), (8,))
    assert decode["dec_tables"] == ((1, 1), (8, 12), (8, 25))
    assert decode["chunk_index"] == ((0, 1), (0, 1), (0, 1))
    assert prefill["kv_pool"] == decode["kv_pool"] == ((2, 2, 64, 2, 4, 8),) * 3


@pytest.fixture
def standin(monkeypatch, tmp_path):
    """TensorRT replaced by the stand-in, the GPU by the CPU, the cache by a temporary folder."""
    from twophase.backends.tensorrt import TensorRTBackend

    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    monkeypatch.setattr(TensorRTBackend, "check_available", classmethod(lambda cls, device="cuda": None))
    monkeypatch.setattr(exporter, "gpu_identity", lambda index=0: {"gpu": "Stand-in GPU",
                                                                   "compute_capability": "9.0"})
    monkeypatch.setenv("TWOPHASE_CACHE", str(tmp_path))
    fake_tensorrt.calls.clear()
    return fake_tensorrt.calls


def test_call_sequence_and_tokens_through_the_standin(standin):
    cfg = {"cache": {"num_blocks": 64, "block_size": 4},
           "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}}
    ref = tiny_llm(**cfg)
    llm = tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    build = [c[0] for c in standin]
    assert build == ["Logger", "Builder", "Builder.create_network", "OnnxParser.parse_from_file",
                     "IBuilderConfig.set_memory_pool_limit",
                     "IBuilderConfig.add_optimization_profile",
                     "IBuilderConfig.add_optimization_profile",
                     "Builder.build_serialized_network", "Logger", "Runtime",
                     "Runtime.deserialize_cuda_engine",
                     "ICudaEngine.create_execution_context",
                     "IExecutionContext.set_optimization_profile_async",
                     "ICudaEngine.create_execution_context",
                     "IExecutionContext.set_optimization_profile_async"]
    assert standin[2] == ("Builder.create_network", 0)              # strongly typed, no flags
    assert all(c[1] == sorted(STEP.names) for c in standin if c[0].endswith("add_optimization_profile"))
    assert [c[1] for c in standin if c[0].endswith("profile_async")] == [0, 1]
    standin.clear()
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(random_prompts(10, longest=60), p)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(random_prompts(10, longest=60), p)]
    runs = [c for c in standin if c[0] == "IExecutionContext.execute_async_v3"]
    mixes = {s.mix for s in llm.engine.steps.records}
    assert {"prefill", "decode"} <= mixes
    # pure-decode steps ran the decode profile with an empty chunk group; the others profile 0
    decodes = [shapes for profile, shapes in ((c[1], c[2]) for c in runs) if profile == 1]
    assert decodes and all(s["chunk_index"][0] == 0 for s in decodes)
    assert len(runs) == len(llm.engine.steps.records)
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def test_engine_is_cached_and_one_for_another_gpu_is_refused(standin, tmp_path):
    cfg = {"cache": {"num_blocks": 32, "block_size": 4}}
    tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    builds = sum(c[0] == "Builder.build_serialized_network" for c in standin)
    tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    assert sum(c[0] == "Builder.build_serialized_network" for c in standin) == builds   # reused
    engine = next(tmp_path.glob("tensorrt/*/model.engine"))
    manifest = json.loads((engine.parent / "manifest.json").read_text())
    assert manifest["gpu"] == "Stand-in GPU" and manifest["tensorrt"] == fake_tensorrt.__version__
    llm = tiny_llm(**cfg)
    sc = llm.config.scheduler
    want = exporter.profile_shapes(llm.model.arch.to_dict(), EngineLimits(
        sc.max_num_seqs, llm.engine.scheduler.budget, llm.max_model_len), 4, 32)
    assert manifest["profiles"] == json.loads(json.dumps(want))
    # the user's own engine folder, built on another GPU: refused with the reason
    manifest["gpu"] = "Other GPU"
    (engine.parent / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(exporter.EngineMismatch, match="built for GPU Other GPU"):
        tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu",
                                 "options": {"engine_dir": str(engine.parent)}})


def test_engine_from_another_tensorrt_version_is_refused(standin, monkeypatch):
    cfg = {"cache": {"num_blocks": 32, "block_size": 4}}
    monkeypatch.setattr(fake_tensorrt, "__version__", "10.0.0")
    llm_cfg = {**cfg, "backend": {"name": "tensorrt", "device": "cpu"}}
    tiny_llm(**llm_cfg)                                         # built by "10.0.0"
    # the cache key names the version, so 11 builds its own; a plan it cannot read is refused
    monkeypatch.setattr(fake_tensorrt.Runtime, "deserialize_cuda_engine", lambda self, b: None)
    monkeypatch.setattr(fake_tensorrt, "__version__", "11.0.0-standin")
    with pytest.raises(exporter.EngineMismatch, match="could not load"):
        tiny_llm(**llm_cfg)


def test_backends_lists_tensorrt_as_unavailable_with_the_reason():
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    from twophase.backends.registry import Registry

    why = Registry().availability("tensorrt", "cuda")
    assert why and "TensorRT is not installed" in why
    with pytest.raises(BackendUnavailable, match="twophase\\[tensorrt\\]"):
        tiny_llm(backend={"name": "tensorrt", "device": "cuda"})


@pytest.mark.gpu
def test_real_tensorrt_equals_torch_on_cuda():
    pytest.importorskip("tensorrt")
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float16"},
           "cache": {"num_blocks": 64}, "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}}
    a = LLM.from_config({**cfg, "backend": {"name": "torch", "device": "cuda"}})
    b = LLM.from_config({**cfg, "backend": {"name": "tensorrt", "device": "cuda"}})
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ta = [o.token_ids for o in a.generate(random_prompts(6, longest=60), p)]
    tb = [o.token_ids for o in b.generate(random_prompts(6, longest=60), p)]
    same = sum(x == y for x, y in zip(ta, tb))
    assert same >= 5, (ta, tb)          # fp16 kernels differ; near-ties may flip a sequence
    assert torch.cuda.is_available()
