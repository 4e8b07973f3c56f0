"""The native kernels on GGUF tensors as stored (``gguf_blocks.h``): each block type's rows
against the ``gguf`` package's own dequantisation (llama.cpp's project's Python reader, an
independent decoding of ggml's layouts), on the vector path and the scalar reference, on both
instruction-set paths."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.native import PATHS, native_or_skip

from twophase.formats import FORMATS

# where each block type keeps its fp16 scales (the other bytes are codes: any value is valid)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# MXFP4 (gpt-oss's): its one scale an E8M0 byte (a power of two), kept small here
E8M0_FIELDS = {"MXFP4": 0}
STORED = (*F16_FIELDS, *E8M0_FIELDS, "F16", "BF16", "F32")


@pytest.fixture(autouse=True)
def _needs_native():
    native_or_skip()


def random_rows(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """``n`` rows of ``k`` values in ``name``'s blocks, as bytes: random codes, small scales."""
    fmt = FORMATS[name]
    if name == "F32":
        return rng.normal(0, 0.05, (n, k)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.normal(0, 0.05, (n, k)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        return (rng.normal(0, 0.05, (n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = k // fmt.block
    raw = rng.integers(0, 256, (n, nb, fmt.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS.get(name, ()):
        raw[..., at:at + 2] = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16)[..., None].view(np.uint8)
    if name in E8M0_FIELDS:            # 2^-10 .. 2^-3 (halved: the doubled codes' scale)
        raw[..., E8M0_FIELDS[name]] = rng.integers(118, 125, (n, nb), dtype=np.uint8)
    return raw.reshape(n, nb * fmt.block_bytes)


def dequantised(name: str, rows: np.ndarray, k: int) -> np.ndarray:
    import gguf

    if name == "F32":
        return rows.view(np.float32).astype(np.float64)
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name]).reshape(len(rows), k).astype(np.float64)


def run(lib, parts: list[tuple[str, np.ndarray]], k: int, x: np.ndarray):
    """(vector path, scalar path, rounded activations) of ``check_matmul_stored``."""
    from twophase.backends.native.kernel import Part, ProjStored

    n = sum(len(r) for _, r in parts)
    proj = ProjStored(n, k, len(parts), (Part * 3)(*(Part(FORMATS[t].ggml_type, len(r), r.ctypes.data)
                                                      for t, r in parts)))
    rows = len(x)
    fast, ref = np.full((rows, n), np.nan, np.float32), np.full((rows, n), np.nan, np.float32)
    xq = np.empty((rows, k), np.float32)
    scratch = np.empty(lib.check_scratch_floats(rows, k), np.float32)
    lib.check_matmul_stored(ctypes.byref(proj), rows, x.ctypes.data, fast.ctypes.data, ref.ctypes.data,
                            xq.ctypes.data, scratch.ctypes.data, 2)
    return fast, ref, xq


@pytest.mark.parametrize("flags", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("name", STORED)
def test_each_stored_type_dots_its_rows_as_gguf_decodes_them(name, flags):
    """Rows of every block type, against the gguf package's dequantised rows times the rounded
    activations (float64): the scalar reference and the vector path both equal up to float
    rounding, where a code, a scale or a minimum read from a wrong bit would be off by far more;
    a row's result does not depend on the rows beside it (batches of 1, 8 and 9 rows: the 8-row
    tiles and their tails)."""
    from twophase.backends.native import kernel

    lib = kernel.load(flags)
    rng = np.random.default_rng(len(name))
    k = 512 if FORMATS[name].block == 256 else 96
    w = random_rows(rng, name, 7, k)
    x = rng.normal(0, 1, (19, k)).astype(np.float32)
    x[:, rng.choice(k, 3, replace=False)] *= 8
    fast, ref, xq = run(lib, [(name, w)], k, x)
    exact = (x if name in ("F16", "BF16", "F32") else xq).astype(np.float64) @ dequantised(name, w, k).T
    err = np.abs(ref - exact).max() / np.abs(exact).max()
    assert err < 1e-5, f"{name}: the scalar path differs from gguf's decoding by {err:.2e}"
    err = np.abs(fast - exact).max() / np.abs(exact).max()
    assert err < 1e-5, f"{name}: the vector path differs from gguf's decoding by {err:.2e}"
    for batch in (1, 8, 9):
        f, r, _ = run(lib, [(name, w)], k, x[:batch])
        assert np.array_equal(r, ref[:batch]) and np.array_equal(f, fast[:batch]), batch


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "Q4_K"])
def test_activations_too_small_for_a_step_round_to_zero_alike_alone_and_in_a_batch(name):
    """A block of 32 activations under 127 x FLT_MIN (its step subnormal, 1 / step infinite)
    rounds to zero codes, not to saturated ones, and the row's result is the same bits alone
    (the one-row path, whose offset types subtract lane sums of the codes) and in a batch (the
    tiled path)."""
    from twophase.backends.native import kernel

    lib = kernel.load(next(iter(PATHS.values())))
    rng = np.random.default_rng(3)
    k = 512 if FORMATS[name].block == 256 else 96
    w = random_rows(rng, name, 7, k)
    x = rng.normal(0, 1, (9, k)).astype(np.float32)
    x[:, 32:64] = np.float32(1e-39) * rng.choice([-1, 1], (9, 32)).astype(np.float32)
    fast, ref, xq = run(lib, [(name, w)], k, x)
    assert not xq[:, 32:64].any() and np.isfinite(fast).all()
    f, r, _ = run(lib, [(name, w)], k, x[:1])
    assert np.array_equal(f, fast[:1]) and np.array_equal(r, ref[:1])


def test_a_projection_of_parts_in_their_own_types_stacks_their_rows():
    """q, k and v in three types (as Q4_K_M files hold attn_v in Q6_K): one projection, its
    rows the parts' rows in order."""
    from twophase.backends.native import kernel

    lib = kernel.load()
    rng = np.random.default_rng(3)
    k = 256
    parts = [("Q4_K", random_rows(rng, "Q4_K", 5, k)), ("Q6_K", random_rows(rng, "Q6_K", 2, k)),
             ("Q8_0", random_rows(rng, "Q8_0", 3, k))]
    x = rng.normal(0, 1, (4, k)).astype(np.float32)
    fast, ref, xq = run(lib, parts, k, x)
    dense = np.concatenate([dequantised(t, r, k) for t, r in parts])
    exact = xq.astype(np.float64) @ dense.T
    assert fast.shape == (4, 10)
    assert np.abs(fast - exact).max() / np.abs(exact).max() < 1e-5


# a Llama whose widths are whole K-quant blocks; its layers' tensors in every type the kernel
# runs (the first two), then as llama.cpp's Q4_K_M stores them
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_K", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
     "ffn_up": "Q4_1", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q6_K", "attn_output": "F16", "ffn_gate": "BF16",
     "ffn_up": "F32", "ffn_down": "Q4_K"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
]


def _stored_gguf(folder, types: dict[str, str]):
    import torch
    import transformers
    from helpers.gguf_writer import write_gguf

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():                     # larger weights: sharper logits
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(folder / "hf")
    return write_gguf(folder / "hf", folder / "model.gguf", types)


@pytest.fixture(scope="module")
def stored_file(tmp_path_factory):
    types = {f"blk.{i}.{t}.weight": kind for i, layer in enumerate(LAYER_TYPES) for t, kind in layer.items()}
    return _stored_gguf(tmp_path_factory.mktemp("stored"), {**types, "output.weight": "Q6_K",
                                                            "token_embd.weight": "Q8_0"})


def test_every_tensor_as_stored_gives_the_dequantised_models_logits(stored_file):
    """The native step on the file's own blocks against torch on the same file dequantised by
    the ``gguf`` package: equal up to the int8 rounding of the activations (a block type read
    wrongly anywhere would be off by far more)."""
    from helpers.models import prefill_all_logits

    from twophase import LLM

    native = LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"},
                              "backend": {"name": "native"}, "cache": {"num_blocks": 64, "block_size": 8}})
    ref = LLM.from_config({"model": {"path": str(stored_file)}, "backend": {"name": "torch"},
                           "cache": {"num_blocks": 64, "block_size": 8}})
    prompts = [[(7 * i + 3 * s) % 290 + 5 for i in range(20 + 9 * s)] for s in range(3)]
    got, want = prefill_all_logits(native, prompts), prefill_all_logits(ref, prompts)
    rel = float((got - want).abs().max() / want.abs().max())
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    # measured 2.4e-2 and 0.94 here, as q4's tiles on the file's Q4_1 twin (3.0e-2 and 0.95);
    # all in F32, 2e-6 and 1.0: the difference is the activations' rounding
    assert rel < 4e-2 and top1 > 0.85, f"logits differ by {rel:.2e} (relative); top-1 agrees at {top1:.2f}"


def test_decode_over_stored_blocks_equals_one_prefill_of_all_the_tokens(stored_file):
    """Each row's arithmetic is its own: a generation's greedy log-probs, decoded one row a step
    over K/V paged in earlier steps, are exactly those of one prefill of all its tokens. On the
    int8 paths: a step of 24 rows or more on AMX tiles computes in bf16 (test_native_amx)."""
    import torch
    from helpers.models import prefill_all_logits

    from twophase import LLM, SamplingParams

    def llm():
        return LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"},
                                "backend": {"name": "native", "options": {"amx": False}},
                                "cache": {"num_blocks": 64, "block_size": 4}})

    prompt = list(range(7, 7 + 21))
    out = llm().generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))[0]
    lp = torch.log_softmax(prefill_all_logits(llm(), [prompt + out.token_ids[:-1]]).float(), dim=-1)
    for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got == {token: float(lp[len(prompt) - 1 + i, token])}, f"token {i}"


def _q2k_file(tmp_path, path, types: dict[str, str]):
    """A copy of the GGUF at ``path`` whose header says the tensors of ``types`` are stored in
    those types (their bytes are left as they are: a reader may decode them, but not run them)."""
    import struct

    import gguf

    raw = bytearray(path.read_bytes())
    for name, kind in types.items():
        key = struct.pack("<Q", len(name)) + name.encode()
        at = raw.index(key) + len(key)
        (n_dims,) = struct.unpack_from("<I", raw, at)
        struct.pack_into("<I", raw, at + 4 + 8 * n_dims, gguf.GGMLQuantizationType[kind])
    out = tmp_path / "retyped.gguf"
    out.write_bytes(bytes(raw))
    return out


def test_what_gguf_cannot_run_is_refused_by_name(stored_file, tmp_path):
    """A tensor type the kernels do not run names the tensor; "gguf" on a backend without it, or
    on a model not from a GGUF file, says why: nothing is converted."""
    from twophase import LLM
    from twophase.errors import ConfigError

    types = {"blk.1.ffn_down.weight": "Q2_K"}
    with pytest.raises(ConfigError, match=r"blk\.1\.ffn_down\.weight is stored as Q2_K, which the native "
                                          r"backend does not run"):
        LLM.from_config({"model": {"path": str(_q2k_file(tmp_path, stored_file, types)), "quantization": "gguf"},
                         "backend": {"name": "native"}})
    with pytest.raises(ConfigError, match="the torch backend does not run 'gguf' weights; backends that do: native"):
        LLM.from_config({"model": {"path": str(stored_file), "quantization": "gguf"}, "backend": {"name": "torch"}})
    with pytest.raises(ConfigError, match="was not loaded from one"):
        LLM.from_config({"model": {"weights": "random", "name": "smollm2-135m", "num_layers": 1,
                                   "quantization": "gguf"}, "backend": {"name": "native"}})


def test_the_plan_counts_the_weights_as_the_file_stores_them(stored_file):
    from twophase import plan as planner
    from twophase.config import load_config
    from twophase.models.gguf_file import GGUFFile

    cfg = load_config(None, {"model": {"path": str(stored_file), "quantization": "gguf"},
                             "backend": {"name": "native"}})
    items = {i.name: i for i in planner.plan(cfg, planner.profile("cpu", 8)).items if i.kind == "weights"}
    header = GGUFFile(stored_file)
    mlp = sum(t.n_bytes for n, t in header.tensors.items() if ".ffn_" in n and not n.endswith("norm.weight"))
    assert items["mlp (native)"].bytes == mlp and "as the GGUF stores them" in items["mlp (native)"].how
    assert items["head (native)"].bytes == header.tensors["output.weight"].n_bytes
    assert items["embedding (native)"].bytes == 300 * 256 * 4 and not items["embedding (native)"].resident


def test_q4_converts_the_tensors_not_in_q4_1_and_says_which(stored_file, caplog):
    """"q4" on the same file: projections in any type (Q8_0 ones too, beside 4-bit parts in one
    projection) become Q4_1, the head Q8_0, and the log names the types converted, at every load.
    The model is then a 4-bit one: on this tiny random model its top token agrees with the
    file's at 0.47 (chance: 0.003), as it does when the file's tensors are all F32."""
    import logging

    from helpers.models import prefill_all_logits

    from twophase import LLM

    with caplog.at_level(logging.WARNING):
        q4 = LLM.from_config({"model": {"path": str(stored_file), "quantization": "q4"},
                              "backend": {"name": "native"}, "cache": {"num_blocks": 64, "block_size": 8}})
    assert "converted to them the tensors stored as" in caplog.text and "Q8_0" in caplog.text
    ref = LLM.from_config({"model": {"path": str(stored_file)}, "cache": {"num_blocks": 64, "block_size": 8}})
    prompts = [[(5 * i) % 290 + 5 for i in range(30)]]
    got, want = prefill_all_logits(q4, prompts), prefill_all_logits(ref, prompts)
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.3
