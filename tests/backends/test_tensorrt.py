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
from twophase.errors import ConfigError, StepFailed
from twophase.exporters import tensorrt as exporter
from twophase.exporters.trt_profiles import cache_key, max_pool_blocks
from twophase.graph.signature import STEP
from twophase.models.families.llama import arch as llama_arch

ARCH = llama_arch(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_profile_shapes_follow_the_config():
    """A small model within the tile: one prefill and one decode profile, at the scheduler's
    own limits; the pool's block count dynamic up to TensorRT's element limit, tuned for the
    pool bound, which the cache key leaves out."""
    prefill, decode = exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), block_size=4,
                                              num_blocks=64)
    assert set(prefill) == set(decode) == set(STEP.names)
    # prefill: up to the token budget, up to max_num_seqs chunks as long as it, no decodes
    assert prefill["input_ids"] == ((1,), (48,), (48,))
    assert prefill["chunk_index"] == ((1, 1), (8, 48), (8, 48))
    assert prefill["chunk_blocks"] == ((2, 1, 1), (2, 8, 12), (2, 8, 25))   # 100 tokens = 25 blocks
    assert prefill["dec_blocks"] == ((2, 0, 1), (2, 0, 1), (2, 0, 1))
    assert prefill["logits_index"] == ((1,), (48,), (48,))
    # decode: one token per sequence, 1..max_num_seqs, no chunk group
    assert decode["input_ids"] == ((1,), (8,), (8,))
    assert decode["dec_blocks"] == ((2, 1, 1), (2, 8, 12), (2, 8, 25))
    assert decode["chunk_index"] == ((0, 1), (0, 1), (0, 1))
    most = max_pool_blocks(ARCH, 4)
    assert most == (2**31 - 1) // (2 * 2 * 2 * 4 * 8)         # layers x K/V x heads x block x head_dim
    pool = ((2, 2, 1, 2, 4, 8), (2, 2, 64, 2, 4, 8), (2, 2, most, 2, 4, 8))
    assert prefill["kv_pool"] == decode["kv_pool"] == pool
    # a pool of another size is tuned for, and keys the same engine; one narrower than a context does not
    other = exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), 4, 1000)
    assert [p["kv_pool"][1] for p in other] == [(2, 2, 1000, 2, 4, 8)] * 2
    assert [{n: s for n, s in p.items() if n != "kv_pool"} for p in other] == \
        [{n: s for n, s in p.items() if n != "kv_pool"} for p in (prefill, decode)]
    assert cache_key(other) == cache_key([prefill, decode])
    assert cache_key(exporter.profile_shapes(ARCH, EngineLimits(8, 48, 100), 4, 20)) != cache_key([prefill, decode])


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
                     "IBuilderConfig.create_timing_cache", "IBuilderConfig.set_timing_cache",
                     "IBuilderConfig.add_optimization_profile",
                     "IBuilderConfig.add_optimization_profile",
                     "Builder.build_serialized_network", "Builder.timing", "Builder.timing",
                     "Logger", "Runtime",
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
    engine = llm.prefill_backend.engine
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


@pytest.mark.exhaustive        # an export; the families' exhaustive run catches the same mistakes
def test_experts_run_in_standard_operators_tensorrt_parses(standin, tmp_path):
    """gpt-oss (experts with biases and the clamped SwiGLU, sinks, windows) through the engine:
    its graph holds the experts in standard ONNX operators (the stand-in's parser, as
    TensorRT's, refuses ONNX Runtime's fused ``MoE``), and gives torch's tokens. (DeepSeek's
    latent attention and routing there: the families' exhaustive run.)"""
    from helpers.hf_models import tiny_hf_model

    pytest.importorskip("transformers")
    tiny_hf_model("gpt_oss", tmp_path / "oss")
    cfg = {"model": {"path": str(tmp_path / "oss")}, "cache": {"num_blocks": 64, "block_size": 8},
           "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 4}}
    prompts = [list(range(5, 45)), list(range(50, 53)), [(7 * i) % 290 + 5 for i in range(30)]]
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM.from_config(cfg).generate(prompts, p)]
    llm = LLM.from_config({**cfg, "backend": {"name": "tensorrt", "device": "cpu"}})
    assert [o.token_ids for o in llm.generate(prompts, p)] == want
    assert "every expert on every token" in llm.prefill_backend.capabilities().computes["moe"]


def test_a_step_cut_into_calls_computes_the_same_tokens(standin, monkeypatch):
    """With a tile this small, long chunks are cut into pieces run one after another and the
    decodes of long contexts split over calls: the tokens are the torch backend's."""
    from twophase.exporters import trt_profiles

    monkeypatch.setattr(trt_profiles, "TILE", 2**14)
    cfg = {"cache": {"num_blocks": 64, "block_size": 4},
           "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}}
    llm = tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    rungs = llm.prefill_backend.rungs
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
    assert llm.prefill_backend.activations.numel() == llm.prefill_backend.engine.device_memory_size_v2
    monkeypatch.setattr(fake_tensorrt.ICudaEngine, "create_execution_context", lambda self, strategy=0: None)
    with pytest.raises(RuntimeError, match="could not create an execution context"):
        tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})


def test_a_pool_of_another_dtype_is_refused(standin):
    with pytest.raises(ConfigError, match="cache.dtype: the tensorrt backend reads K/V in float32, not float16"):
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
    assert manifest["profiles"] == json.loads(json.dumps(cache_key(want)))
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


def test_the_pool_is_tuned_for_as_bound_and_another_size_reuses_the_engine(standin):
    """The builder tunes for the opt shape: the pool's is the pool bound (not TensorRT's
    maximum), and a pool of another size (both wider than any context) reuses the engine."""
    cfg = {"model": {"max_model_len": 100}, "cache": {"num_blocks": 32, "block_size": 4}}
    llm = tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    assert [p["kv_pool"][1][2] for p in llm.prefill_backend.engine.profiles] == [32] * len(llm.prefill_backend.rungs)
    tiny_llm(**{**cfg, "cache": {"num_blocks": 48, "block_size": 4}}, backend={"name": "tensorrt", "device": "cpu"})
    assert sum(c[0] == "Builder.build_serialized_network" for c in standin) == 1


TINY_BLOCK = 2 * 2 * 2 * 4 * 16        # the tiny model's pool: layers x K/V x heads x block x head_dim


@pytest.fixture
def small_limit(standin, monkeypatch):
    """TensorRT's element limit cut to 40 of the tiny model's blocks (and a tile to match), in
    the backend and the stand-in alike."""
    from twophase.exporters import trt_profiles

    limit = 40 * TINY_BLOCK + 100
    monkeypatch.setattr(trt_profiles, "TILE", 2**14)
    monkeypatch.setattr(trt_profiles, "ELEMENT_LIMIT", limit)
    monkeypatch.setattr(fake_tensorrt, "ELEMENT_LIMIT", limit)
    return {"model": {"max_model_len": 100}, "scheduler": {"max_num_batched_tokens": 40, "max_num_seqs": 8}}


def test_the_pool_stays_within_tensorrts_element_limit(small_limit):
    """An automatic pool is sized within the limit (the backend declares it); a fixed pool past
    it is refused by its block count, before any engine is built."""
    llm = tiny_llm(**small_limit, cache={"num_blocks": "auto", "block_size": 4},
                   backend={"name": "tensorrt", "device": "cpu"})
    assert llm.prefill_backend.capabilities().max_pool_elements == 40 * TINY_BLOCK + 100
    assert llm.num_blocks == 40 and llm.kv_cache.pool.numel() == 40 * TINY_BLOCK
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(ConfigError, match=r"cache.num_blocks: a pool of 41 blocks holds 20,992 elements; "
                                          r"TensorRT binds no tensor of more than 20,580 .* at most 40 blocks"):
        tiny_llm(**small_limit, cache={"num_blocks": 41, "block_size": 4},
                 backend={"name": "tensorrt", "device": "cpu"})


def test_the_standin_refuses_a_pool_past_the_limit_as_tensorrt_does(small_limit, monkeypatch):
    """Past the backend's own check: the engine's profiles stop at the limit, so TensorRT
    refuses the larger pool's shape; a profile that reaches past it does not build."""
    import twophase.backends.tensorrt as backend
    from twophase.errors import TwophaseError
    from twophase.exporters import trt_profiles

    monkeypatch.setattr(backend, "check_pool_elements", lambda kv, arch: None)
    cfg = {**small_limit, "cache": {"num_blocks": 41, "block_size": 4},
           "backend": {"name": "tensorrt", "device": "cpu"}}
    with pytest.raises(StepFailed, match=r"TensorRT refused shape \(2, 2, 41, 2, 4, 16\) for kv_pool"):
        tiny_llm(**cfg).generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    monkeypatch.setattr(trt_profiles, "max_pool_blocks", lambda arch, block_size, slots=None: 41)
    with pytest.raises(TwophaseError, match="TensorRT failed to build the engine"):
        tiny_llm(**cfg)
    (error,) = [c for c in fake_tensorrt.calls if c[0] == "Builder.error"]
    assert error[2] == {"kv_pool": 41 * TINY_BLOCK}


def test_engine_refusals_are_errors_that_say_so(standin, monkeypatch):
    """A profile TensorRT refuses (its bindings raise), and an engine whose outputs are not
    the shapes this model's step needs (the outputs are sized as the engine says)."""
    cfg = {"cache": {"num_blocks": 32, "block_size": 4}, "backend": {"name": "tensorrt", "device": "cpu"}}
    real = fake_tensorrt.IExecutionContext.set_optimization_profile_async
    with monkeypatch.context() as m, pytest.raises(exporter.EngineMismatch, match=(
            r"refused optimisation profile 0 \(Error in set optimization profile async.\)")):
        m.setattr(fake_tensorrt.IExecutionContext, "set_optimization_profile_async",
                  lambda self, index, stream: real(self, index + 5, stream))
        tiny_llm(**cfg)
    shape = fake_tensorrt.IExecutionContext.get_tensor_shape
    monkeypatch.setattr(fake_tensorrt.IExecutionContext, "get_tensor_shape",
                        lambda self, name: (lambda s: (s[0], s[1] + 1) if name == "logits" else s)(shape(self, name)))
    llm = tiny_llm(**cfg)
    assert llm.prefill_backend.out_dtypes == {"logits": torch.float32, "new_k": torch.float32, "new_v": torch.float32}
    with pytest.raises(StepFailed, match=r"the engine's outputs are logits \(1, 513\)"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_builds_share_a_timing_cache_beside_the_engines(standin, tmp_path, caplog):
    cfg = {"cache": {"num_blocks": 32, "block_size": 4}}
    tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu"})
    (cache,) = (tmp_path / "tensorrt").glob("timing-*.cache")
    assert cache.name == "timing-Stand-in-GPU-sm9.0-trt11.0.0-standin.cache"
    assert [c[2] for c in standin if c[0] == "Builder.timing"] == ["timed", "timed"]
    standin.clear()
    tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu", "options": {"rebuild": True}})
    assert [c[2] for c in standin if c[0] == "Builder.timing"] == ["cached", "cached"]
    cache.write_bytes(b"not a timing cache")                      # corrupt: timed again, and rewritten
    standin.clear()
    tiny_llm(**cfg, backend={"name": "tensorrt", "device": "cpu", "options": {"rebuild": True}})
    assert [c[2] for c in standin if c[0] == "Builder.timing"] == ["timed", "timed"]
    assert "could not read the timing cache" in caplog.text
    assert json.loads(cache.read_bytes())["entries"]


def test_a_missing_onnx_package_is_named_with_the_extra(standin, monkeypatch):
    """At load, before the pool is allocated, not as an ImportError halfway through bind."""
    import sys

    monkeypatch.setitem(sys.modules, "onnxscript", None)         # not installed
    with pytest.raises(BackendUnavailable, match=r"needs onnxscript: pip install -e '\.\[tensorrt\]'") as got:
        tiny_llm(cache={"num_blocks": 32, "block_size": 4}, backend={"name": "tensorrt", "device": "cpu"})
    assert "load" in [entry.name for entry in got.traceback]


def test_backends_lists_tensorrt_as_unavailable_with_the_reason():
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    from twophase.backends.registry import Registry

    why = Registry().availability("tensorrt", "cuda")
    assert why and "TensorRT is not installed" in why
    with pytest.raises(BackendUnavailable, match=r"pip install -e '\.\[tensorrt\]'"):
        tiny_llm(backend={"name": "tensorrt", "device": "cuda"})


@pytest.mark.gpu
def test_real_tensorrt_equals_torch_on_cuda():
    """TensorRT in fp16 against the torch reference in float32 on the CPU (the weights the ONNX
    export reads: random ones drawn on CUDA would be other numbers), up to near-ties."""
    pytest.importorskip("tensorrt")
    from twophase.testing import assert_greedy_match, logprob_gaps

    cfg = {"model": {"name": "tiny", "weights": "random"},
           "cache": {"num_blocks": 64}, "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}}
    ref = LLM.from_config({**cfg, "model": {**cfg["model"], "dtype": "float32"}})
    trt = LLM.from_config({**cfg, "model": {**cfg["model"], "dtype": "float16"},
                           "backend": {"name": "tensorrt", "device": "cuda"}})
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = random_prompts(6, longest=60)
    for i, (x, y) in enumerate(zip(trt.generate(prompts, p), ref.generate(prompts, p))):
        assert_greedy_match(x.token_ids, y.token_ids, logprob_gaps(y), f"prompt {i}", tie=0.05)
    assert torch.cuda.is_available()
