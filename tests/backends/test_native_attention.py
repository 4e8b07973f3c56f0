"""The native step's attention alone (``check_attention``), over a pool of each K/V format with
scattered blocks: it equals float64 softmax attention over the decoded rows, and a row's output
is the same bits whether it runs alone (its keys split into parts across the threads) or in a
batch (a task a row and head), on the AVX-512 and AVX2 builds alike."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from helpers.native import PATHS as ALL_PATHS
from helpers.native import native_or_skip

from twophase.kv_formats import kv_format

FORMATS = ["float32", "float16", "bfloat16", "int8"]
# (query heads, K/V heads, head_dim): three query heads a K/V head, and one K/V head for four
SHAPES = [(6, 2, 64), (4, 1, 128)]
CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200, 700]
BS = 16
PATHS = {p: ALL_PATHS[p] for p in ("native", "avx2")}


@pytest.fixture(autouse=True)
def _needs_native():
    native_or_skip()


def _case(fmt: str, heads: int, kv_heads: int, hd: int):
    """A pool of ``fmt`` (its blocks in random order in each sequence's table), the queries, and
    the decoded float32 K/V the reference reads."""
    rng = np.random.default_rng(heads * hd)
    width = -(-max(CONTEXTS) // BS)
    nb = width * len(CONTEXTS)
    plain = torch.from_numpy(rng.normal(0, 1, (1, 2, nb, kv_heads, BS, hd)).astype(np.float32))
    pool = kv_format(fmt).encode(plain).contiguous()
    decoded = kv_format(fmt).decode(pool, torch.float32).numpy()
    tables = rng.permutation(nb).reshape(len(CONTEXTS), width).astype(np.int64)
    q = rng.normal(0, 2, (len(CONTEXTS), heads * hd)).astype(np.float32)
    return pool, decoded, tables, q


def _attention(lib, fmt, heads, kv_heads, hd, pool, tables, q, rows, ctx=None, window=0):
    """check_attention's output for the queries q, a row each of the sequences ``rows`` (a
    decode row each at its CONTEXTS length, or at ``ctx``: a prompt chunk's rows where they
    repeat a sequence), layer 0 windowed to ``window`` keys if given."""
    from twophase.backends.native import KV_TYPES, kernel

    windows = np.array([window], np.int32)
    m = kernel.Model(layers=1, dim=heads * hd, heads=heads, kv_heads=kv_heads, head_dim=hd, scale=hd ** -0.5,
                     window=windows.ctypes.data if window else None)
    ctx = np.array([CONTEXTS[r] for r in rows] if ctx is None else ctx, np.int32)
    seq = np.array(rows, np.int32)
    scratch = np.empty(lib.step_scratch_floats(ctypes.byref(m), len(rows), int(ctx.max()), 2), np.float32)
    s = kernel.Step(rows=len(rows), tables=tables.ctypes.data, width=tables.shape[1], seq=seq.ctypes.data,
                    ctx=ctx.ctypes.data, pool=pool.data_ptr(), num_blocks=pool.shape[2], block_size=BS,
                    kv_type=KV_TYPES[pool.dtype], scratch=scratch.ctypes.data, max_ctx=int(ctx.max()),
                    threads=2)
    qs = np.ascontiguousarray(q)
    out = np.full((len(rows), heads * hd), np.nan, np.float32)
    lib.check_attention(ctypes.byref(m), ctypes.byref(s), qs.ctypes.data, out.ctypes.data)
    return out


def _reference(decoded, tables, q, heads, kv_heads, hd):
    out = np.empty(q.shape, np.float64)
    for r, n in enumerate(CONTEXTS):
        blocks = tables[r, : -(-n // BS)]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            k = decoded[0, 0, blocks, kh].reshape(-1, hd)[:n].astype(np.float64)
            v = decoded[0, 1, blocks, kh].reshape(-1, hd)[:n].astype(np.float64)
            s = k @ q[r, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[r, h * hd:(h + 1) * hd] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{h}q{k}kv{d}" for h, k, d in SHAPES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_is_softmax_over_the_decoded_rows_and_alone_equals_batched(fmt, shape):
    from twophase.backends.native import kernel

    heads, kv_heads, hd = shape
    pool, decoded, tables, q = _case(fmt, heads, kv_heads, hd)
    want = _reference(decoded, tables, q, heads, kv_heads, hd)
    every = list(range(len(CONTEXTS)))
    outs = {}
    for path, flags in PATHS.items():
        lib = kernel.load(flags)
        batched = _attention(lib, fmt, heads, kv_heads, hd, pool, tables, q, every)   # q: a row a sequence
        err = np.abs(batched - want).max()
        assert err < 2e-5, f"{path}: {err:.2e} from float64 attention over the decoded rows"
        alone = np.concatenate([_attention(lib, fmt, heads, kv_heads, hd, pool, tables, q[r:r + 1], [r])
                                for r in every])
        assert np.array_equal(alone.view(np.uint32), batched.view(np.uint32)), f"{path}: alone != batched"
        outs[path] = batched
    assert np.array_equal(outs["native"].view(np.uint32), outs["avx2"].view(np.uint32))


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_prompt_chunks_rows_share_each_parts_keys_and_equal_each_row_alone(fmt, window):
    """A prompt chunk's rows (one sequence, consecutive positions) read each part's keys once for
    several rows; each row's output is still the bits it has alone (as a decode at its context)
    and float64 attention over its own keys (its window's, when layer 0 has one: the rows'
    windows then start a key apart)."""
    from twophase.backends.native import kernel

    heads, kv_heads, hd = 4, 1, 128
    pool, decoded, tables, _ = _case(fmt, heads, kv_heads, hd)
    r = CONTEXTS.index(700)
    ctx = np.arange(650, 701, dtype=np.int32)
    q = np.random.default_rng(5).normal(0, 2, (len(ctx), heads * hd)).astype(np.float32)
    blocks = tables[r, : -(-700 // BS)]
    for path, flags in PATHS.items():
        lib = kernel.load(flags)
        chunk = _attention(lib, fmt, heads, kv_heads, hd, pool, tables, q, [r] * len(ctx), ctx, window)
        for i, n in enumerate(ctx):
            alone = _attention(lib, fmt, heads, kv_heads, hd, pool, tables, q[i:i + 1], [r], [n], window)
            assert np.array_equal(alone.view(np.uint32), chunk[i:i + 1].view(np.uint32)), f"{path}: row {i}"
            lo = n - window if window and n > window else 0
            k = decoded[0, 0, blocks, 0].reshape(-1, hd)[lo:n].astype(np.float64)
            v = decoded[0, 1, blocks, 0].reshape(-1, hd)[lo:n].astype(np.float64)
            for h in range(heads):
                sc = k @ q[i, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
                w = np.exp(sc - sc.max())
                assert np.abs(chunk[i, h * hd:(h + 1) * hd] - (w / w.sum()) @ v).max() < 2e-5
