"""The iree backend: the module compiled through MLIR equals the torch model, alone and with the
phases routed to different backends; its module is cached by manifest."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.models import (
    GREEDY_TOKENS,
    assert_prefix_hits_give_torch_tokens,
    assert_same_tokens_with_preemption,
    tiny_llm,
)

from twophase import LLM, SamplingParams
from twophase.contract import BackendConfig, BackendUnavailable, KVCache
from twophase.core.batch import decode_batch, prefill_batch
from twophase.testing import assert_greedy_match

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.turbine")


@pytest.mark.parametrize("backend", [
    {"name": "iree"},
    {"name": "iree", "options": {"pool": "owned"}},
    {"prefill": {"name": "iree"}, "decode": {"name": "torch"}},
    {"prefill": {"name": "onnxruntime"}, "decode": {"name": "iree"}},
])
def test_greedy_tokens_equal_torch_with_chunking_and_preemption(backend, preempting_torch_tokens):
    assert_same_tokens_with_preemption(backend, preempting_torch_tokens)


@pytest.mark.exhaustive      # CI time: a cached chunk through iree is in test_logits_match_torch_on_the_same_pool
def test_prefix_cache_hits_through_iree():
    assert_prefix_hits_give_torch_tokens("iree")


def _iree_for(llm, pool="shared"):
    backend = llm.registry.get("iree")()
    backend.load(llm.spec,
                 BackendConfig("iree", options={"pool": pool}))
    return backend


@pytest.mark.parametrize("pool", ["shared", "owned"])
@pytest.mark.parametrize("case", ["fresh prompts", "chunk after cached tokens",
                                  "decodes of unequal lengths", "all positions"])
def test_logits_match_torch_on_the_same_pool(case, pool):
    """Both backends run the same batch on copies of one pool: logits within 1e-4 relative, and
    the same K/V written (into the engine's pool, or the one the module keeps). Decodes go
    through the module's ``decode`` entry point."""
    llm = tiny_llm(cache={"num_blocks": 128, "block_size": 4})
    eng = llm.engine
    reqs = [eng.add_request(list(range(3 + i, 3 + i + n)), SamplingParams(max_tokens=8, ignore_eos=True))
            for i, n in enumerate((9, 30, 21))]
    if case != "fresh prompts":
        while any(r.num_output_tokens < 2 for r in reqs):
            eng.step()
    if case == "chunk after cached tokens":
        reqs = [eng.add_request(list(range(3, 3 + 9)) + list(range(200, 230)), SamplingParams(max_tokens=3))]
    sched = eng.scheduler.schedule()
    before = llm.kv_cache.pool.clone()
    passed = before.clone()
    iree = _iree_for(llm, pool)
    iree.bind_kv_cache(KVCache(before, 4))
    assert iree.capabilities().shares_kv_pool == (pool == "shared")
    if case == "decodes of unequal lengths":
        assert not sched.prefills and len({r.num_computed_tokens for r in sched.decodes}) > 1
        batch = decode_batch(sched.decodes, eng.kv)
        want, got = llm.prefill_backend.decode(batch), iree.decode(batch)
    else:
        items = [(r, r.num_computed_tokens, 1) for r in sched.decodes] + \
                [(r, r.num_computed_tokens, n) for r, n in sched.prefills]   # decodes as chunks
        if case == "chunk after cached tokens":
            assert any(s > 0 and n > 1 for _, s, n in items)
        batch = prefill_batch(items, eng.kv)
        batch.logits = "all" if case == "all positions" else "last"
        want, got = llm.prefill_backend.prefill(batch), iree.prefill(batch)
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    after = before if pool == "shared" else iree.read_kv_pool()
    assert torch.allclose(after, llm.kv_cache.pool, atol=1e-5)        # the same K/V written
    if pool == "owned":
        assert torch.equal(before, passed)        # the module wrote its own pool, not this one


@pytest.mark.exhaustive        # a second compile; the cache's damage path stays in the default lane below
def test_module_is_cached_by_manifest_and_seen_stale():
    from twophase.exporters import mlir
    from twophase.exporters.cache import is_fresh

    llm = tiny_llm()
    spec = llm.spec
    cached = mlir.export(spec, "cpu", 16)                     # the other tests' module
    assert mlir.export(spec, "cpu", 16) == cached
    manifest = json.loads((cached.parent / "manifest.json").read_text())
    assert manifest["block_size"] == 16 and "--iree-llvmcpu-target-cpu=host" in manifest["target"]
    assert manifest["files"]["model.vmfb"] == cached.stat().st_size
    other = dataclasses.replace(llm.spec, seed=1)
    assert not is_fresh(cached.parent, mlir.manifest_for(other, "cpu", 16))     # stale weights
    assert not is_fresh(cached.parent, mlir.manifest_for(spec, "cpu", 8))       # other block size


# one more IREE compile (35 s on a Zen 3 core): the default lane checks build_cached's rebuild
# through onnxruntime's export
@pytest.mark.exhaustive
def test_a_truncated_module_is_rebuilt(tmp_path, caplog):
    from twophase.exporters import mlir
    from twophase.exporters.cache import is_fresh

    spec = tiny_llm().spec
    cached = mlir.export(spec, "cpu", 16)
    folder = tmp_path / "module"
    import shutil

    shutil.copytree(cached.parent, folder)
    vmfb = folder / "model.vmfb"
    vmfb.write_bytes(vmfb.read_bytes()[:1000])                 # truncated: rebuilt
    assert mlir.export(spec, "cpu", 16, out_dir=folder) == vmfb
    # rebuilt, not reused: complete again by its manifest (IREE's output is not byte-identical
    # from one compile to the next, so sizes are not compared)
    assert "stale or incomplete" in caplog.text and vmfb.stat().st_size > 1000
    assert is_fresh(folder, mlir.manifest_for(spec, "cpu", 16))


def test_owned_pool_costs_no_engine_memory_and_refuses_shared_phases(caplog):
    llm = tiny_llm(backend={"name": "iree", "options": {"pool": "owned"}})
    assert "copies all of it" in caplog.text                   # its cost, said at load
    assert llm.kv_cache.pool.device.type == "meta"             # the module holds the only pool
    assert llm.prefill_backend.read_kv_pool().shape == llm.kv_cache.pool.shape
    assert not llm.prefill_backend.read_kv_pool().any()                 # zeroed on the device
    # clear_kv zeroes whatever the pool held (a fresh allocation may be zero by chance)
    full = tiny_llm(cache={"num_blocks": 8}).kv_cache.pool.clone().fill_(1.5)
    other = _iree_for(llm, "owned")
    other.bind_kv_cache(KVCache(full, 16))
    assert bool((other.read_kv_pool() == 1.5).all())           # a copy of what it was given
    other.entry["clear_kv"](other.pool_view)
    assert not other.read_kv_pool().any()
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="keeps its own KV pool"):
        tiny_llm(backend={"prefill": {"name": "iree", "options": {"pool": "owned"}},
                          "decode": {"name": "torch"}})


def test_bad_settings_are_refused_by_name():
    from twophase.backends.registry import Registry
    from twophase.errors import ConfigError

    why = Registry().availability("iree", "cuda")
    if why:                                       # no GPU here: the reason, not a traceback
        assert "cuda" in why.lower()
        with pytest.raises(BackendUnavailable, match="(?i)cuda"):
            tiny_llm(backend={"name": "iree", "device": "cuda"})
    with pytest.raises(ConfigError, match="backend.options.pool"):
        tiny_llm(backend={"name": "iree", "options": {"pool": "mine"}})
    with pytest.raises(ConfigError, match="float32"):
        LLM.from_config({"model": {"name": "tiny", "weights": "random", "dtype": "bfloat16"},
                         "backend": {"name": "iree"}})
    with pytest.raises(ConfigError, match="threads"):
        tiny_llm(backend={"name": "iree", "options": {"threads": 0}})


@pytest.mark.exhaustive        # a 35 s compile for a target no machine here runs; test_gpu compiles and runs it
def test_module_compiles_for_cuda(tmp_path):
    """The compile side of the CUDA path, which needs no GPU: sm_80 code with all four entry
    points. Running it needs a GPU (``tests/test_gpu.py``)."""
    from twophase.exporters import mlir

    llm = tiny_llm()
    spec = llm.spec
    path = mlir.export(spec, "cuda", 16, out_dir=tmp_path)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert "--iree-cuda-target=sm_80" in manifest["target"] and manifest["host_cpu"] is None
    import iree.runtime as rt

    names = set(rt.VmModule.mmap(rt.VmInstance(), str(path)).function_names)
    assert {"prefill", "decode", "write_kv", "clear_kv"} <= names, names


@pytest.mark.slow
@pytest.mark.exhaustive        # the tiny model's tests check the same module; this compiles 30 layers
def test_default_model_greedy_equals_torch(default_llm, default_prompts):
    """Single requests, then a mixed batch with chunked prefill under a small token budget."""
    llm = LLM.from_config({"backend": {"name": "iree"}, "cache": {"num_blocks": 64},
                           "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 8}})
    p = SamplingParams(max_tokens=GREEDY_TOKENS, logprobs=2)
    ref = default_llm.generate(default_prompts, p)
    mixed = llm.generate(default_prompts, p)
    assert llm.report(mixed)["steps_by_mix"].get("mixed")
    single = [llm.generate([q], p)[0] for q in default_prompts[:2]]
    for i, r in enumerate(ref):
        gaps = [sorted(lp.values(), reverse=True) for lp in r.logprobs]
        gaps = [a - b for a, b, *_ in gaps]
        if i < len(single):
            assert_greedy_match(single[i].token_ids, r.token_ids, gaps, f"prompt {i} alone")
        assert_greedy_match(mixed[i].token_ids, r.token_ids, gaps, f"prompt {i} in a batch")


def test_cli_exports_the_module(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "tiny.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\n[cache]\nblock_size = 16\n')
    run = subprocess.run([sys.executable, "-m", "twophase", "export", "--format", "mlir", str(cfg)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    path = run.stdout.strip().splitlines()[-1]
    assert path.endswith("model.vmfb") and "mlir" in path
    bad = subprocess.run([sys.executable, "-m", "twophase", "export", "--format", "tensorrt", str(cfg)],
                         capture_output=True, text=True, timeout=600)
    if "TensorRT is not installed" in bad.stderr:             # this machine: a clear message
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
