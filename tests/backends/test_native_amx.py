"""The native kernels' AMX path (``amx_tiles.h``): each stored block type's rows decoded into bf16
tiles and dotted with bf16 activations, against the ``gguf`` package's dequantisation of the
same blocks rounded to bf16 (an independent decoding), and against the kernels' own decoding from
the layout's definition. Runs where the CPU has AMX and Linux lends its tile state; elsewhere it
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
        errs[name] = float((got - want).abs().max() / want.abs().max())
    # measured: 1.4e-2 against 2.3e-2 (max error over the logits, relative to their largest)
    assert errs["tiles"] < 0.75 * errs["int8"], errs


@pytest.mark.parametrize("bad", ["yes", 0, -3, 2.5])
def test_the_amx_option_is_true_false_or_a_number_of_rows(stored_file, bad):  # noqa: F811
    """On every machine, with tiles or without: a wrong value is refused by name."""
    native_or_skip()
    from twophase import LLM
    from twophase.errors import ConfigError

    with pytest.raises(ConfigError, match="backend.options.amx"):
        LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"},
                         "backend": {"name": "native", "options": {"amx": bad}}})
