"""The tensorrt backend on both sides of the boundary this machine cannot cross: the profiles and
the memory they imply, computed from a config, and the calls the backend makes, against a
stand-in for TensorRT that keeps its rules and runs the engine's ONNX graph
(``fake_tensorrt``). Real TensorRT runs only in the GPU-marked test."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fake_tensorrt
from helpers.models import random_prompts, tiny_llm

from twophase import LLM, SamplingParams
from twophase.contract import BackendUnavailable, EngineLimits
from twophase.errors import ConfigError
from twophase.exporters import tensorrt as exporter
from twophase.exporters.trt_profiles import MAX_POOL_BLOCKS
from twophase.graph.signature import STEP
from twophase.models.families.llama import arch as llama_arch

ARCH = llama_arch(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_profile_shapes_follow_the_config():
    """A small model within the tile: one prefill and one decode profile, at the scheduler's
    own limits; the pool's block count dynamic."""
    prefill, decode = exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), block_size=4,
                                              num_blocks=64)
    assert set(prefill) == set(decode) == set(STEP.names)
    # prefill: up to the token budget, up to max_num_seqs chunks as long as it, no decodes
    assert prefill["input_ids"] == ((1,), (48,), (48,))
    assert prefill["chunk_index"] == ((1, 1), (8, 48), (8, 48))
    assert prefill["chunk_tables"] == ((1, 1), (8, 12), (8, 25))      # 100 tokens = 25 blocks
    assert prefill["dec_tables"] == ((0, 1), (0, 1), (0, 1))
    assert prefill["logits_index"] == ((1,), (48,), (48,))
    # decode: one token per sequence, 1..max_num_seqs, no chunk group
    assert decode["input_ids"] == ((1,), (8,), (8,))
    assert decode["dec_tables"] == ((1, 1), (8, 12), (8, 25))
    assert decode["chunk_index"] == ((0, 1), (0, 1), (0, 1))
    pool = ((2, 2, 1, 2, 4, 8), (2, 2, MAX_POOL_BLOCKS, 2, 4, 8), (2, 2, MAX_POOL_BLOCKS, 2, 4, 8))
    assert prefill["kv_pool"] == decode["kv_pool"] == pool
    # a pool of another size keys the same engine; one narrower than a context does not
    assert exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), 4, 1000) == [prefill, decode]
    assert exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), 4, 20) != [prefill, decode]


@pytest.fixture
def standin(monkeypatch, tmp_path):
    return fake_tensorrt.install(monkeypatch, tmp_path)


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
                     "IExecutionContext.set_device_memory",
                     "IExecutionContext.set_optimization_profile_async",
                     "ICudaEngine.create_execution_context",
                     "IExecutionContext.set_device_memory",
                     "IExecutionContext.set_optimization_profile_async"]
    assert standin[2] == ("Builder.create_network", 0)              # strongly typed, no flags
    # both contexts on one buffer of the larger profile's size, none of their own
    user = fake_tensorrt.ExecutionContextAllocationStrategy.USER_MANAGED
    assert [c[1] for c in standin if c[0] == "ICudaEngine.create_execution_context"] == [user, user]
    engine = llm.backend.engine
    sizes = {c[1] for c in standin if c[0] == "IExecutionContext.set_device_memory"}
    assert sizes == {max(engine.get_device_memory_size_for_profile_v2(p) for p in (0, 1))}
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
    # within the tile: one call a phase a step (a mixed step's decodes run the decode profile)
    steps = llm.engine.steps.records
    assert len(runs) == sum((r.prefill_seqs > 0) + (r.decode_seqs > 0) for r in steps)
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def test_a_step_cut_into_calls_computes_the_same_tokens(standin, monkeypatch):
    """With a tile this small, long chunks are cut into pieces run one after another and the
    decodes of long contexts split over calls: the tokens are the torch backend's."""
    from twophase.exporters import trt_profiles

    monkeypatch.setattr(trt_profiles, "TILE", 2**14)
    cfg = {"cache": {"num_blocks": 64, "block_size": 4},
           "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}}
    llm = tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    rungs = llm.backend.rungs
    assert len(rungs) > 2 and min(r.chunk for r in rungs if r.phase == "prefill") < 40
    standin.clear()
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = random_prompts(10, longest=60)
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == [o.token_ids for o in tiny_llm(**cfg).generate(prompts, p)]
    runs = [c for c in standin if c[0] == "IExecutionContext.execute_async_v3"]
    assert len(runs) > len(llm.engine.steps.records) + 10
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


def test_contexts_share_one_activation_buffer(standin, monkeypatch):
    """Two contexts that each allocated their largest profile's memory would not fit this
    device; one buffer of the backend's own does. A context TensorRT cannot create is an error
    that says so."""
    monkeypatch.setattr(fake_tensorrt, "DEVICE_MEMORY", 1)
    cfg = {"cache": {"num_blocks": 32, "block_size": 4}}
    llm = tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    assert llm.backend.activations.numel() == llm.backend.engine.device_memory_size_v2
    monkeypatch.setattr(fake_tensorrt.ICudaEngine, "create_execution_context", lambda self, strategy=0: None)
    with pytest.raises(RuntimeError, match="could not create an execution context"):
        tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})


def test_a_pool_of_another_dtype_is_refused(standin):
    with pytest.raises(ConfigError, match="cache.dtype: the tensorrt backend's engine reads a "
                                          "torch.float32 pool, not torch.float16"):
        tiny_llm(cache={"num_blocks": 32, "block_size": 4, "dtype": "float16"},
                 backend={"name": "tensorrt", "device": "cpu"})


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
    want = exporter.profile_shapes(llm.model.arch, EngineLimits(
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
