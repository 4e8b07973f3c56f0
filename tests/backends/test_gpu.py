"""The CUDA paths: the torch backend (CUDA graphs, bf16, every family), IREE's module on the
cuda driver (GPU-marked: skipped without a CUDA device), and, on any machine, how the plan's
check reads CUDA memory.

Random weights on CUDA are drawn by CUDA's generator, so they are not the CPU's for the same
seed: a test comparing the two devices copies the CPU model's weights into the CUDA one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from twophase import LLM, SamplingParams
from twophase.testing import assert_greedy_match, logprob_gaps

# bf16 against bf16 with other kernels (a CUDA graph pads the batch to its bucket, so cuBLAS
# may pick another kernel): logits are bf16 before their cast (steps of 2^-6 at 2..4), and a
# random model's top-2 gaps are a few hundredths, so a flip within this gap is a near-tie.
# Measured on the CPU for llama3-1b's shape at 4 layers, bf16 against float32 diverged at gaps
# of 0.014 to 0.052 (scripts/gpu_bench.py greedy measures it on the GPU).
BF16_TIE = 0.1
F32_TIE = 1e-3          # float32 on a GPU: other reduction orders than the CPU's


def _llm(**backend_options) -> LLM:
    return LLM.from_config({"model": {"name": "llama3-1b", "weights": "random", "num_layers": 4},
                            "backend": {"device": "cuda", "options": backend_options},
                            "cache": {"num_blocks": 256}})


def copy_weights(dst: LLM, src: LLM) -> None:
    """``src``'s weights (the CPU's random draw) into ``dst``'s torch model, cast to its dtype."""
    dst.prefill_backend.model.load_state_dict(src.prefill_backend.model.state_dict())


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode():
    """Both bf16 with one set of weights: the graphs' tokens are eager decoding's up to the
    first near-tie of eager's own logits."""
    prompts = [[100 + i + j for j in range(17 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    graphs = _llm(cuda_graphs=True)
    eager = _llm(cuda_graphs=False)
    copy_weights(eager, graphs)
    a = graphs.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert graphs.prefill_backend.graphs is not None and graphs.prefill_backend.graphs.captured
    assert eager.prefill_backend.graphs is None
    for i, (x, y) in enumerate(zip(a, b)):
        assert_greedy_match(x.token_ids, y.token_ids, logprob_gaps(y), f"prompt {i}", tie=BF16_TIE)


@pytest.mark.gpu
def test_cuda_matches_cpu_in_float32():
    cfg = {"model": {"name": "tiny", "weights": "random", "dtype": "float32"},
           "cache": {"num_blocks": 64}}
    cpu = LLM.from_config(cfg)
    gpu = LLM.from_config({**cfg, "backend": {"device": "cuda"}})
    copy_weights(gpu, cpu)
    prompts = [[5, 6, 7, 8], list(range(3, 60))]
    p = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    for i, (x, y) in enumerate(zip(gpu.generate(prompts, p), cpu.generate(prompts, p))):
        assert_greedy_match(x.token_ids, y.token_ids, logprob_gaps(y), f"prompt {i}", tie=F32_TIE)


@pytest.mark.gpu
def test_blocks_all_free_after_a_cuda_run():
    llm = _llm()
    llm.generate([[7] * 40] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.kv.num_free_blocks == llm.num_blocks
    assert torch.isfinite(llm.kv_cache.pool).all()


@pytest.mark.gpu
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
    assert llm.prefill_backend.capabilities().shares_kv_pool == (pool == "shared")
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers.hf_models import FAMILIES, tiny_hf_model

    out = {}
    for name in FAMILIES:
        folder = tmp_path_factory.mktemp(name)
        out[name] = (tiny_hf_model(name, folder), folder)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2",
                                    "qwen3", "qwen3_moe"])
def test_each_family_greedy_on_cuda_equals_transformers(families, family):
    """tests/models/test_families.py on CUDA: each family's tiny checkpoint (float32, CUDA
    graphs where the pool is plain) against transformers on the CPU, up to near-ties."""
    ref, folder = families[family]
    llm = LLM.from_config({"model": {"path": str(folder), "dtype": "float32"},
                           "backend": {"device": "cuda"}, "cache": {"num_blocks": 64, "block_size": 8}})
    prompts = [list(range(5, 45)), [(7 * i) % 290 + 5 for i in range(30)]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            g = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        want = g.sequences[0, len(prompt):].tolist()
        top = torch.stack(g.scores)[:, 0].float().topk(2, dim=-1).values
        assert_greedy_match(out.token_ids, want, (top[:, 0] - top[:, 1]).tolist(), family, tie=F32_TIE)
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


class CachingAllocator:
    """torch's CUDA caching allocator as the plan's check sees it: freed blocks stay reserved
    (in use, to the device) until ``empty_cache``; allocations reuse them first."""

    GiB = 2**30

    def __init__(self, total: int = 141 * GiB, other: int = 2 * GiB):
        self.total, self.other = total, other        # other: the context, other processes
        self.allocated = self.reserved = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n                          # the blocks stay in torch's cache

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.other - self.reserved, self.total


def test_cuda_memory_is_read_with_torchs_freed_blocks_handed_back(monkeypatch):
    """An engine loaded after another one was closed in the same process: its weights reuse
    the blocks the first freed, which the device still counted as in use. Read without
    handing them back, the weights would seem to take nothing."""
    from twophase.plan import check

    fake = CachingAllocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    GiB = CachingAllocator.GiB
    fake.alloc(16 * GiB)                                   # the first engine's weights
    fake.free(16 * GiB)                                    # ... closed
    before = check.in_use("cuda")
    fake.alloc(6 * GiB)                                    # the next engine's weights
    after = check.in_use("cuda")
    assert after - before == 6 * GiB
    assert before == 2 * GiB                               # nothing of the first engine's left
