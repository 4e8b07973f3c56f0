"""Rolling a sequence back (speculative tokens rejected): blocks wholly past the new length go
back to the pool, the rest stay, and no rejected token ever becomes a prefix-cache hit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.cache.spec import attention_spec
from twophase.core.kv_manager import KVManager
from twophase.core.request import Request
from twophase.core.sampling_params import SamplingParams

DRAFT = 999                      # a token id only drafts use: never committed


def committed(pos: int) -> int:
    return 1 + pos % 53


@settings(deadline=None, max_examples=300, database=None)
@given(bs=st.sampled_from([1, 2, 4, 8]),
       rounds=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=25),
       windows=st.sampled_from([(None,), (6,), (None, 6), (None, 11, 11)]))
def test_truncate_keeps_exactly_the_committed_blocks(bs: int, rounds: list[tuple[int, int]],
                                                     windows: tuple[int | None, ...]) -> None:
    """Also in groups (full and sliding layers): a sliding group gives back what its window
    passed, never what a rollback could need."""
    kv = KVManager(num_blocks=256, block_size=bs, specs=[attention_spec(w, 1, 1, "float32") for w in windows])
    req = Request("r", [committed(0)], SamplingParams(max_tokens=4000), 0.0)
    for k, accept in rounds:
        accept = min(accept, k)
        # verify pass: k drafts after the committed tokens get slots and K/V; the first
        # ``accept`` are what the target model would say, the rest are wrong
        assert kv.allocate(req, k)
        n = req.num_computed_tokens + accept
        start = req.num_computed_tokens
        req.token_ids += [committed(p) if p < n else DRAFT for p in range(start, start + k)]
        kv.computed_blocks(req)               # a lookup may hash blocks that hold drafts
        # the rejected ones are rolled back before anything is published
        del req.token_ids[n:]
        req.num_computed_tokens = n
        kv.truncate(req, n)
        kv.cache_computed(req)
        kv.release_outside_window(req)
        assert all(len(t) == kv.blocks_for(n) for t in kv.block_tables(req)), \
            "blocks past the length must be freed, the rest kept"
        held = kv.held_blocks("r")
        assert kv.num_free_blocks == 256 - len(held) == 256 - len(set(held)), "a block leaked or was freed twice"
        # a sliding group holds its window's blocks, no more
        window_blocks = [len(t) - (0 if w is None else min(len(t), max(0, n - w + 1) // bs))
                         for w, t in zip(windows, kv.block_tables(req))]
        assert len(held) == sum(window_blocks)
    # a newcomer with the committed tokens hits every full block; one with a draft hits none past it
    probe = Request("p", list(req.token_ids) + [7], SamplingParams(), 0.0)
    assert kv.hit_tokens(kv.computed_blocks(probe)) == req.num_computed_tokens // bs * bs
    drafted = Request("d", [DRAFT] * (bs + 1), SamplingParams(), 0.0)
    assert kv.computed_blocks(drafted) == []
    kv.free(req)
    assert kv.num_free_blocks == 256 and not any(kv.pool.ref_cnt)


def test_truncating_a_published_block_is_refused() -> None:
    kv = KVManager(num_blocks=8, block_size=2)
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    assert kv.allocate(req, 5)
    req.num_computed_tokens = 5
    kv.cache_computed(req)                  # blocks [1, 2] and [3, 4] are published
    with pytest.raises(RuntimeError, match="published"):
        kv.truncate(req, 3)
