"""The native kernels' AMX path: each stored block type's rows decoded into bf16 tiles and dotted
with bf16 activations (``amx_tiles.h``), against the ``gguf`` package's dequantisation of the
same blocks rounded to bf16 (an independent decoding), and against the kernels' own decoding from
the layout's definition; a prompt chunk's attention on the tiles (``amx_attention.h``) against
float64 attention. Runs where the CPU has AMX and Linux lends its tile state; elsewhere it
skips, and the path is untested there."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.native import native_or_skip
from test_native_stored import STORED, dequantised, random_rows, stored_file  # noqa: F401 (a fixture)

from twophase.formats import FORMATS


@pytest.fixture(scope="module")
def lib():
    native_or_skip()
    from twophase.backends.native import kernel

    so = kernel.load()
    if so.amx_request() != 1:
        pytest.skip("no AMX tiles here (CPU, compiler or kernel): the tile path is untested on this machine")
    return so


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16, ties to even, as float64."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def amx_run(lib, parts: list[tuple[str, np.ndarray]], k: int, x: np.ndarray):
    """(tiles, the kernels' bf16 reference) of ``check_matmul_amx``."""
    from twophase.backends.native.kernel import Part, ProjStored

    n = sum(len(r) for _, r in parts)
    proj = ProjStored(n, k, len(parts), (Part * 3)(*(Part(FORMATS[t].ggml_type, len(r), r.ctypes.data)
                                                      for t, r in parts)))
    fast, ref = np.full((len(x), n), np.nan, np.float32), np.full((len(x), n), np.nan, np.float32)
    scratch = np.empty(lib.check_scratch_floats(len(x), k), np.float32)
    got = lib.check_matmul_amx(ctypes.byref(proj), len(x), x.ctypes.data, fast.ctypes.data, ref.ctypes.data,
                               scratch.ctypes.data, 2)
    assert got == 1, f"the tiles were not used ({got})"
    return fast, ref


@pytest.mark.parametrize("name", STORED)
def test_each_stored_type_on_the_tiles_dots_its_rows_as_gguf_decodes_them(lib, name):
    """40 weight rows (a panel of 32 and a part one) against 37 activation rows (a block of 32
    and a part one): within float32 summation of the gguf package's rows rounded to bf16, where
    a code, a scale or a pair put in the wrong lane would be off by far more."""
    rng = np.random.default_rng(len(name) + 7)
    k = 512 if FORMATS[name].block == 256 else 96
    w = random_rows(rng, name, 40, k)
    x = rng.normal(0, 1, (37, k)).astype(np.float32)
    fast, ref = amx_run(lib, [(name, w)], k, x)
    want = bf16(x) @ bf16(dequantised(name, w, k).astype(np.float32)).T
    scale = np.abs(bf16(x)) @ np.abs(bf16(dequantised(name, w, k).astype(np.float32))).T
    np.testing.assert_array_less(np.abs(fast - ref), 1e-5 * scale + 1e-7)
    # the gguf package's float32 rows may round to the other bf16 neighbour of a few weights
    np.testing.assert_array_less(np.abs(fast - want), 2e-3 * scale + 1e-6)


def test_parts_of_other_types_stack_their_rows_on_the_tiles(lib):
    """A fused q/k/v projection whose parts are stored in three types, 20 + 9 + 7 rows: panels
    that straddle parts."""
    rng = np.random.default_rng(3)
    k = 256
    parts = [("Q4_K", random_rows(rng, "Q4_K", 20, k)), ("Q8_0", random_rows(rng, "Q8_0", 9, k)),
             ("F16", random_rows(rng, "F16", 7, k))]
    x = rng.normal(0, 1, (33, k)).astype(np.float32)
    fast, _ = amx_run(lib, parts, k, x)
    w = np.concatenate([bf16(dequantised(t, r, k).astype(np.float32)) for t, r in parts])
    want = bf16(x) @ w.T
    np.testing.assert_array_less(np.abs(fast - want), 2e-3 * (np.abs(bf16(x)) @ np.abs(w).T) + 1e-6)


def test_a_prefill_on_the_tiles_is_nearer_the_float_model_than_int8_activations(lib, stored_file):  # noqa: F811
    """A whole model on the file's blocks (Q4_0 to Q6_K), prefilled in steps of 87 rows: with the
    tiles (bf16 activations) and without (int8 a run), against torch on the same file dequantised
    by the ``gguf`` package. The tiles keep the activations' 16 bits, so they land nearer."""
    import torch
    from helpers.models import prefill_all_logits

    from twophase import LLM

    def native(amx: bool):
        return LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"},
                                "backend": {"name": "native", "options": {"amx": amx}},
                                "cache": {"num_blocks": 64, "block_size": 8}})

    ref = LLM.from_config({"model": {"path": str(stored_file)}, "backend": {"name": "torch"},
                           "cache": {"num_blocks": 64, "block_size": 8}})
    prompts = [[(7 * i + 3 * s) % 290 + 5 for i in range(20 + 9 * s)] for s in range(3)]
    want = prefill_all_logits(ref, prompts)
    tiles, int8 = native(True), native(False)
    assert tiles.engine.executor.prefill_backend.amx and not int8.engine.executor.prefill_backend.amx
    errs = {}
    for name, llm in (("tiles", tiles), ("int8", int8)):
        got = prefill_all_logits(llm, prompts)
        errs[name] = float(torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                                      reduction="none").sum(-1).mean())
    # measured: mean KL 1.4e-4 against 4.2e-4 (the chunks' attention on the tiles too, in bf16)
    assert errs["tiles"] < 0.5 * errs["int8"], errs


@pytest.mark.parametrize("bad", ["yes", 0, -3, 2.5])
def test_the_amx_option_is_true_false_or_a_number_of_rows(stored_file, bad):  # noqa: F811
    """On every machine, with tiles or without: a wrong value is refused by name."""
    native_or_skip()
    from twophase import LLM
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="backend.options.amx"):
        LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"},
                         "backend": {"name": "native", "options": {"amx": bad}}})


def _attend(lib, heads, kv_heads, hd, ctx, seq, amx, window=0, fmt="float32", sinks=None, cap=0.0):
    """check_attention's output for rows at contexts ``ctx`` of sequences ``seq`` (each sequence's
    keys random, its blocks scattered), with the tiles from ``amx`` rows (0: never); and float64
    softmax attention over the same decoded keys."""
    import torch

    from twophase.backends.native import KV_TYPES, kernel
    from twophase.kv_formats import kv_format

    rng = np.random.default_rng(heads * hd + len(ctx))
    bs, width = 16, -(-int(ctx.max()) // 16)
    nb = width * (int(seq.max()) + 1)
    plain = torch.from_numpy(rng.normal(0, 1, (1, 2, nb, kv_heads, bs, hd)).astype(np.float32))
    pool = kv_format(fmt).encode(plain).contiguous()
    decoded = kv_format(fmt).decode(pool, torch.float32).numpy().astype(np.float64)
    tables = rng.permutation(nb).reshape(-1, width).astype(np.int64)
    q = rng.normal(0, 2, (len(ctx), heads * hd)).astype(np.float32)
    windows, sk = np.array([window], np.int32), None if sinks is None else np.asarray(sinks, np.float32)
    m = kernel.Model(layers=1, dim=heads * hd, heads=heads, kv_heads=kv_heads, head_dim=hd, scale=hd ** -0.5,
                     window=windows.ctypes.data if window else None, attn_cap=cap,
                     sinks=None if sk is None else sk.ctypes.data)
    scratch = np.empty(lib.step_scratch_floats(ctypes.byref(m), len(ctx), int(ctx.max()), 2), np.float32)
    s = kernel.Step(rows=len(ctx), tables=tables.ctypes.data, width=width, seq=seq.ctypes.data, ctx=ctx.ctypes.data,
                    pool=pool.data_ptr(), num_blocks=nb, block_size=bs, kv_type=KV_TYPES[pool.dtype],
                    scratch=scratch.ctypes.data, max_ctx=int(ctx.max()), threads=2, team=2, amx=amx)
    out = np.full(q.shape, np.nan, np.float32)
    lib.check_attention(ctypes.byref(m), ctypes.byref(s), q.ctypes.data, out.ctypes.data)
    want, G = np.empty(q.shape), heads // kv_heads
    for i, (n, sq) in enumerate(zip(ctx, seq)):
        lo = n - window if window and n > window else 0
        for h in range(heads):
            k, v = (decoded[0, kv, tables[sq], h // G].reshape(-1, hd)[lo:n] for kv in (0, 1))
            sc = k @ q[i, h * hd:(h + 1) * hd] / np.sqrt(hd)
            sc = cap * np.tanh(sc / cap) if cap else sc
            top = sc.max() if sk is None else max(sc.max(), sk[h])
            w = np.exp(sc - top)
            want[i, h * hd:(h + 1) * hd] = w @ v / (w.sum() + (0 if sk is None else np.exp(sk[h] - top)))
    return out, want


# (query heads, K/V heads, head_dim): Gemma 3 270M's, SmolLM2's, and more heads a K/V head than a tile's rows
ATT_SHAPES = [(4, 1, 256), (9, 3, 64), (40, 1, 32)]


@pytest.mark.parametrize("shape", ATT_SHAPES, ids=[f"{h}q{k}kv{d}" for h, k, d in ATT_SHAPES])
@pytest.mark.parametrize("window,fmt", [(0, "float32"), (40, "int8")])
def test_a_prompt_chunks_attention_on_the_tiles_is_softmax_attention(lib, shape, window, fmt):
    """A step of two decodes, a chunk too short for the tiles and a long one (a cached prefix of
    250 keys, 53 rows: tasks of several positions and a part one, parts of 128 keys and a short
    one): the long chunk's rows within bf16's rounding of float64 attention over their own keys
    (their window's, when there is one); the other rows the vector path's bits, as each alone."""
    heads, kv_heads, hd = shape
    ctx = np.array([300, 77] + list(range(120, 125)) + list(range(251, 304)), np.int32)
    seq = np.array([0, 1] + [2] * 5 + [3] * 53, np.int32)
    out, want = _attend(lib, heads, kv_heads, hd, ctx, seq, amx=16, window=window, fmt=fmt)
    vector, _ = _attend(lib, heads, kv_heads, hd, ctx, seq, amx=0, window=window, fmt=fmt)
    # measured: at most 7.2e-3, a mean of 6.1e-4 (q.k kept to about 16 bits, the weights and values
    # rounded to bf16); with q.k in bf16 alone (kh qh), at least 1.2e-2 and 7.8e-4
    err = np.abs(out[7:] - want[7:])
    assert err.max() < 1e-2 and err.mean() < 7e-4, (err.max(), err.mean())
    assert np.array_equal(out[:7].view(np.uint32), vector[:7].view(np.uint32))
    assert np.abs(vector - want).max() < 2e-5


def test_sinks_and_a_soft_cap_on_the_tiles(lib):
    """gpt-oss's sinks (one more term in each head's denominator) and Gemma 2's soft cap of the
    scores, on a chunk of 199 rows from the sequence's start."""
    ctx, seq = np.arange(1, 200, dtype=np.int32), np.zeros(199, np.int32)
    out, want = _attend(lib, 4, 1, 64, ctx, seq, amx=1, sinks=[0.5, -1.0, 2.0, 3.0], cap=5.0)
    assert np.abs(out - want).max() < 1e-2


def test_heads_the_tiles_do_not_divide_keep_the_vector_path(lib):
    """head_dim 48 (not a multiple of the tiles' 32 values a row): a long chunk's rows are the
    vector path's bits, as with the tiles off."""
    ctx, seq = np.arange(1, 60, dtype=np.int32), np.zeros(59, np.int32)
    on, want = _attend(lib, 4, 2, 48, ctx, seq, amx=16)
    off, _ = _attend(lib, 4, 2, 48, ctx, seq, amx=0)
    assert np.array_equal(on.view(np.uint32), off.view(np.uint32)) and np.abs(on - want).max() < 2e-5
