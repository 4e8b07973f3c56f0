"""The pool layout: each spec's bytes and freeing by hand, and one function whose pool the planner
shows and the engine allocates."""

from __future__ import annotations

import dataclasses

import pytest

from twophase import LLM
from twophase.cache.layout import KVHeads, PoolSettings, lay_out_pool
from twophase.cache.spec import FullAttentionSpec, SlidingWindowSpec, attention_spec, concurrency
from twophase.config import load_config
from twophase.contract import Capabilities
from twophase.plan import plan, profile
from twophase.plan.model_source import planned_model

TINY = {"name": "tiny", "weights": "random"}


def test_attention_specs_count_their_bytes_by_hand():
    full = FullAttentionSpec(num_kv_heads=2, head_dim=64, format="float16")
    assert full.bytes_per_token() == 2 * 2 * 64 * 2 and full.page_bytes(16) == 16 * 512
    # int8 rows carry a float16 scale a run of 32 values
    assert FullAttentionSpec(2, 64, "int8").bytes_per_token() == 2 * 2 * (64 + 2 * 2)
    assert full.bytes_per_sequence() == 0 and full.window is None


def test_a_sliding_spec_holds_its_window_and_a_chunk_however_long_the_sequence():
    s = SlidingWindowSpec(1, 8, "float32", sliding_window=64)
    assert s.window == 64 and attention_spec(64, 1, 8, "float32") == s
    assert s.live_blocks(10, 512, 16) == 1                    # short: every block
    assert s.live_blocks(100_000, 1, 16) == s.live_blocks(1_000_000, 1, 16) == 5
    full = FullAttentionSpec(1, 8, "float32")
    assert full.live_blocks(100_000, 1, 16) == 6250
    assert concurrency([full, s], 1000, 1600, 16, 16) == (1000 - 1) // (100 + 5)


def _settings(**kw) -> PoolSettings:
    base = PoolSettings(block_size=16, num_blocks=None, memory_bytes=1 << 20, format="float32", max_num_seqs=4,
                        max_num_batched_tokens=None, chunked_prefill=True, max_model_len=None, device_kind="cpu")
    return dataclasses.replace(base, **kw)


def test_the_layout_is_a_pure_function_of_its_inputs():
    arch = planned_model(load_config({"model": TINY}).model).arch
    caps = Capabilities()
    a = lay_out_pool(arch, _settings(), caps, [caps], 1 << 30)
    assert a == lay_out_pool(arch, _settings(), caps, [caps], 1 << 30)
    assert a.page_bytes == arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4 * 16
    assert a.num_blocks == (1 << 20) // a.page_bytes and a.token_budget == 512
    # a backend's index limit caps the pool, and the layout says so
    per_block = arch.num_layers * 2 * arch.num_kv_heads * 16 * arch.head_dim
    small = dataclasses.replace(caps, max_pool_elements=10 * per_block)
    capped = lay_out_pool(arch, _settings(), caps, [small], 1 << 30)
    assert (capped.num_blocks, capped.at_backend_limit) == (10, True)
    # a backend that cannot chunk a prompt gets a whole request a step; fewer sequences where it says
    whole = lay_out_pool(arch, _settings(), dataclasses.replace(caps, chunked_prefill=False, max_num_seqs=2),
                         [caps], 1 << 30)
    assert (whole.chunked_prefill, whole.token_budget, whole.max_num_seqs) == (False, whole.max_model_len, 2)
    # the backends' own K/V shape sizes the page, not the architecture's
    narrow = lay_out_pool(arch, _settings(), caps, [caps], 1 << 30, kv=KVHeads(1, 8))
    assert narrow.page_bytes == arch.num_layers * 2 * 1 * 8 * 4 * 16


@pytest.mark.parametrize("cache", [{"memory_gb": 0.001}, {"num_blocks": 40}])
def test_the_engine_allocates_the_pool_the_plan_shows(cache):
    cfg = load_config({"model": TINY, "cache": cache})
    p = plan(cfg, profile("cpu"))
    with LLM(cfg) as llm:
        assert llm.num_blocks == p.num_blocks
        assert llm.kv_cache.pool.numel() * llm.kv_cache.pool.element_size() == p.total("kv cache")
        assert llm.max_model_len == min(p.max_model_len, p.kv_tokens)
