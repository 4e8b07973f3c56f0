"""TensorRT's profiles for real model shapes (no weights, no TensorRT): the activation memory
they imply, the configs refused for it, and how a step is cut into calls that fit them."""

from __future__ import annotations

import pytest
from helpers import fake_tensorrt
from hypothesis import given
from hypothesis import strategies as st

from twophase.arch import ModelArch
from twophase.backends.trt_calls import plan_calls
from twophase.contract import EngineLimits
from twophase.errors import ConfigError
from twophase.exporters import trt_profiles
from twophase.exporters.trt_profiles import ELEMENT_LIMIT, profile_memory, profile_shapes, rung_tensors, rungs
from twophase.models.families.llama import arch as llama_arch
from twophase.models.param_counts import num_params
from twophase.models.shapes import SHAPES

H200 = 141 * 10**9
LLAMA3_8B = SHAPES["llama3-8b"]
DEFAULTS = EngineLimits(64, 4096, 131072)     # on CUDA: max_num_seqs, the token budget, the model's context
POOL_BLOCKS = 50_000                          # llama3-8b: 105 GB of 16-token blocks beside its weights


def fake_arch(arch: ModelArch) -> dict:
    return {"H": arch.num_heads, "key": arch.num_kv_heads * arch.head_dim,
            "mlp": 2 * arch.intermediate_size, "vocab": arch.vocab_size, "hidden": arch.hidden_size,
            "itemsize": 2}


def test_llama3_8b_profiles_fit_an_h200_with_the_default_limits():
    need = profile_memory(LLAMA3_8B, DEFAULTS, POOL_BLOCKS, 16, "bfloat16")
    weights = 2 * num_params(SHAPES["llama3-8b"])
    pool = POOL_BLOCKS * 16 * 32 * 2 * 8 * 128 * 2
    assert need + weights + pool < H200
    assert need < 10 * 2**30                  # activations: a few GiB, not terabytes
    ladder = rungs(LLAMA3_8B, DEFAULTS, POOL_BLOCKS, 16)
    for r in ladder:
        assert max(rung_tensors(LLAMA3_8B, r, 16).values()) <= ELEMENT_LIMIT, r
    # the full context is served, and the narrowest rungs take every sequence the scheduler sends
    assert max(r.blocks for r in ladder) == 131072 // 16
    assert [r.rows for r in ladder if r.phase == "decode"][-1] == DEFAULTS.max_num_seqs
    # the stand-in's own estimate of what TensorRT would allocate agrees they fit
    arch = fake_arch(LLAMA3_8B)
    for profile in profile_shapes(LLAMA3_8B, DEFAULTS, 16, POOL_BLOCKS):
        tensors = fake_tensorrt._profile_tensors(arch, profile)
        assert max(tensors.values()) <= fake_tensorrt.ELEMENT_LIMIT
        assert fake_tensorrt._activation_bytes(arch, tensors) < 10 * 2**30


def test_the_pool_is_within_the_element_limit_and_the_standin_refuses_a_larger_one():
    """llama3-8b in 16-token blocks: a block is 2^20 elements, so TensorRT binds at most 2,047
    (the profiles stop there, tuned for the pool bound); a profile reaching 2,048 blocks, or
    50,000 (what an H200 would hold), is refused by the stand-in, as TensorRT's builder refuses
    a tensor past 2^31 - 1 elements."""
    assert trt_profiles.pool_block_elements(LLAMA3_8B, 16) == 2**20
    assert trt_profiles.max_pool_blocks(LLAMA3_8B, 16) == 2047
    arch = fake_arch(LLAMA3_8B)
    for profile in profile_shapes(LLAMA3_8B, DEFAULTS, 16, 1000):
        assert [s[2] for s in profile["kv_pool"]] == [1, 1000, 2047]
        assert fake_tensorrt._profile_tensors(arch, profile)["kv_pool"] <= fake_tensorrt.ELEMENT_LIMIT
        for blocks in (2048, POOL_BLOCKS):
            wider = {**profile, "kv_pool": (*profile["kv_pool"][:2], (32, 2, blocks, 8, 16, 128))}
            assert fake_tensorrt._profile_tensors(arch, wider)["kv_pool"] > fake_tensorrt.ELEMENT_LIMIT


def test_deepseek_v3_s_latent_pool_is_profiled_as_one_plane_of_its_latent():
    """DeepSeek V3: the pool's profile is ``[61, 1, NB, 1, BS, 576]``, a block 61 x 16 x 576
    elements, so 16-token blocks fit TensorRT's limit 3.8 thousand at a time (per-head K and V
    would fit 53); the prefill's expanded keys and values (128 heads x (192 + 128) a cached
    token) bound the rungs' width, every tensor within the element limit; a context whose
    expanded keys and values would not fit one tensor is refused with the longest that does."""
    ds = SHAPES["deepseek-v3"]
    assert trt_profiles.pool_block_elements(ds, 16) == 61 * 16 * 576
    assert trt_profiles.max_pool_blocks(ds, 16) == ELEMENT_LIMIT // (61 * 16 * 576)
    assert trt_profiles.key_width(ds) == 128 * (128 + 64 + 128)
    with pytest.raises(ConfigError, match="32768 tokens: .* at most 13104"):
        rungs(ds, EngineLimits(64, 4096, 32768), 100_000, 16)
    limits = EngineLimits(64, 4096, 8192)
    for profile in profile_shapes(ds, limits, 16, 1000):
        assert [s[:2] + s[3:] for s in profile["kv_pool"]] == [(61, 1, 1, 16, 576)] * 3
    ladder = rungs(ds, limits, 1000, 16)
    for r in ladder:
        assert max(rung_tensors(ds, r, 16).values()) <= ELEMENT_LIMIT, r
    # every expert on every token: [256, T, 7168] at most a profile's largest tensor, so 291 tokens a call
    assert trt_profiles.mlp_width(ds) == 256 * 7168 + 2 * 2048 and max(r.tokens for r in ladder) == 291
    # a decode attends over the latents as they lie: its rows are sized by 576 a key, not 40,960
    widest = next(r for r in ladder if r.phase == "decode")
    assert widest.rows == min(64, 291, trt_profiles.TILE // (widest.blocks * 16 * 576)) > 1


def test_the_profiles_per_dimension_maxima_did_not_fit():
    """What one profile at every limit at once implies (the earlier profiles): refused by the
    stand-in as TensorRT refuses it."""
    arch = fake_arch(LLAMA3_8B)
    width = 131072 // 16
    square = {"input_ids": [[1], [4096], [4096]], "chunk_index": [[0, 1], [1, 4096], [64, 4096]],
              "chunk_blocks": [[32, 0, 1], [32, 1, width], [32, 64, width]],
              "dec_blocks": [[32, 0, 1], [32, 1, width], [32, 64, width]],
              "logits_index": [[1], [4096], [4096]], "kv_pool": [[32, 2, 1, 8, 16, 128]] * 3}
    tensors = fake_tensorrt._profile_tensors(arch, square)
    assert tensors["chunk_scores"] > 10**12 and tensors["decode_kv"] > 8 * 10**9


def test_a_huge_config_is_refused_with_the_figures():
    too_big = (r"scheduler.max_num_batched_tokens: 131072 tokens a step: TensorRT's \w+ tensor would hold "
               r"[\d,]+ elements, more than its limit of 2,147,483,647")
    with pytest.raises(ConfigError, match=too_big):
        profile_memory(LLAMA3_8B, EngineLimits(1024, 131072, 131072), POOL_BLOCKS, 16, "bfloat16")
    with pytest.raises(ConfigError, match=r"model.max_model_len: 1048576 tokens.*at most 524288"):
        profile_memory(LLAMA3_8B, EngineLimits(64, 4096, 1 << 20), 1 << 20, 16, "bfloat16")
    need = profile_memory(LLAMA3_8B, DEFAULTS, POOL_BLOCKS, 16, "bfloat16")
    with pytest.raises(ConfigError, match=r"activations need \d+\.\d GiB, but only 1\.0 GiB"):
        trt_profiles.check_fits(need, 2**30)


TINY = llama_arch(vocab_size=10, hidden_size=32, intermediate_size=16, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 90)), min_size=1, max_size=12),
       st.sampled_from([2**13, 2**14, 2**16]))
def test_calls_cover_each_chunk_in_order_within_their_rungs(seqs, tile):
    starts, lens = [s for s, _ in seqs], [n for _, n in seqs]
    limits = EngineLimits(12, 1100, 400)
    try:
        trt_profiles.TILE, saved = tile, trt_profiles.TILE
        ladder = rungs(TINY, limits, 200, 4)
    finally:
        trt_profiles.TILE = saved
    seen = {s: 0 for s in range(len(seqs))}
    for call in plan_calls(ladder, starts, lens, 4):
        r = ladder[call.rung]
        assert len(call.pieces) <= r.rows and sum(n for _, _, n in call.pieces) <= r.tokens
        assert len({s for s, _, _ in call.pieces}) == len(call.pieces)     # one piece a sequence
        for s, offset, n in call.pieces:
            assert offset == seen[s] and n <= r.chunk                       # in order, no gap
            assert -(-(starts[s] + offset) // 4) <= r.blocks                # its context fits
            assert (r.phase == "decode") == (lens[s] == 1)
            seen[s] += n
    assert [seen[s] for s in range(len(seqs))] == lens
