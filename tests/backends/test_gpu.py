"""The CUDA paths: the torch backend, and IREE's module on the cuda driver (skipped without a
CUDA device)."""

from __future__ import annotations

import pytest
import torch

from twophase import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _llm(**backend_options) -> LLM:
    return LLM.from_config({"model": {"name": "llama3-1b", "weights": "random", "num_layers": 4},
                            "backend": {"device": "cuda", "options": backend_options},
                            "cache": {"num_blocks": 256}})


def test_cuda_graph_decode_equals_eager_decode():
    prompts = [[100 + i + j for j in range(17 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    graphs = _llm(cuda_graphs=True)
    eager = _llm(cuda_graphs=False)
    a = [o.token_ids for o in graphs.generate(prompts, params)]
    b = [o.token_ids for o in eager.generate(prompts, params)]
    assert graphs.backend.graphs is not None and graphs.backend.graphs.captured
    agree = sum(x == y for x, y in zip(a, b))
    assert agree >= len(prompts) - 1, (a, b)       # bf16: allow one near-tie divergence


def test_cuda_matches_cpu_in_float32():
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 64}}
    cpu = LLM.from_config(cfg)
    gpu = LLM.from_config({**cfg, "backend": {"device": "cuda"}})
    prompts = [[5, 6, 7, 8], list(range(3, 60))]
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in gpu.generate(prompts, p)] == \
        [o.token_ids for o in cpu.generate(prompts, p)]


def test_blocks_all_free_after_a_cuda_run():
    llm = _llm()
    llm.generate([[7] * 40] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.kv.num_free_blocks == llm.num_blocks
    assert torch.isfinite(llm.kv_cache.pool).all()


@pytest.mark.parametrize("pool", ["shared", "owned"])
def test_iree_on_cuda_equals_torch(pool):
    """IREE's CUDA path (sm_80 code; the engine's pool imported through DLPack, or the module's
    own) against the torch backend on the CPU: greedy tokens with chunked prefill and
    preemption."""
    pytest.importorskip("iree.runtime")
    from twophase.backends.registry import Registry

    why = Registry().availability("iree", "cuda")
    if why:
        pytest.skip(why)
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 24, "block_size": 16},
           "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 4}}
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM.from_config(cfg).generate(prompts, p)]
    llm = LLM.from_config({**cfg, "backend": {"name": "iree", "device": "cuda",
                                              "options": {"pool": pool}}})
    assert llm.backend.capabilities().shares_kv_pool == (pool == "shared")
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.kv.num_free_blocks == llm.num_blocks
