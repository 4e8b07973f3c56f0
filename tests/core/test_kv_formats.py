"""K/V stored in 16 and 8 bits (``cache.dtype``): int8 rows are llama.cpp's q8_0 blocks, a
request's tokens do not depend on its batch, chunks, preemption, prefix hits or drafts within
one format, the predictions stay close to the float32 cache's, and backends that cannot read a
format refuse it by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import tiny_llm

from twophase import LLM, SamplingParams
from twophase.errors import ConfigError
from twophase.kv_formats import RUN, kv_format
from twophase.measure.quality import kl_divergence, shipped_text
from twophase.testing import assert_greedy_match, logprob_gaps

INT8 = kv_format("int8")


def test_int8_rows_hold_the_bytes_of_ggml_q8_0_blocks():
    """The gguf package's own q8_0 quantiser (ggml's reference, in numpy) gives, block by block,
    the same float16 scale and the same 32 codes; decoding is codes times scale."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = (torch.randn(40, 128, generator=torch.Generator().manual_seed(0)) * 3)
    x[3, :32] = 0.0                                    # an all-zero run: scale 0, codes 0
    x[5, 7] = 1e4                                      # one outlier run
    rows = INT8.encode(x).numpy().view(np.uint8)       # [40, 128 + 8]
    ref = quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(40, -1, 34)
    n = 128 // RUN
    scales, codes = rows[:, 128:].reshape(40, n, 2), rows[:, :128].reshape(40, n, RUN)
    assert np.array_equal(scales, ref[..., :2]) and np.array_equal(codes, ref[..., 2:])
    back = INT8.decode(INT8.encode(x), torch.float32)
    want = quants.dequantize(ref.reshape(40, -1), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(back.numpy(), want.reshape(40, 128))


def test_fp8_saturates_where_e4m3_has_no_value():
    """float8 e4m3 has no infinity: a cast beyond +-448 is NaN, which would poison every later
    softmax; the format clamps instead, and rounds within range as torch's cast does."""
    fp8 = kv_format("fp8")
    x = torch.tensor([[1e4, -1e4, 448.0, 0.3, -0.0]])
    got = fp8.decode(fp8.encode(x), torch.float32)
    assert not got.isnan().any()
    assert got[0, :3].tolist() == [448.0, -448.0, 448.0]
    assert got[0, 3] == x[0, 3].to(torch.float8_e4m3fn).float() and got[0, 3] != x[0, 3]


@pytest.fixture(scope="module")
def prose_ids(default_llm) -> list[int]:
    return default_llm.tokenizer.encode(shipped_text())[:320]


# How far batching moves a chosen token's log-probability in each format (the default model,
# 12 prompts x 24 tokens alone, batched under preemption and with n-gram drafts; AMD EPYC, AVX2):
# float16 1.3e-3, int8 3.7e-2, fp8 7.0e-2. A GEMM computes a row's last bits differently by how
# many rows it multiplies (torch's linear on that CPU: every row count from 2 to 64 differs
# from one row's product), and a stored format rounds such a difference, now and then, into a
# whole step of one stored value: a step of q8_0 or e4m3 moves logits far more than float16's.
BATCH_SHIFT = {"float16": 5e-3, "int8": 0.1, "fp8": 0.2}


@pytest.mark.parametrize("fmt", [pytest.param("float16", marks=pytest.mark.exhaustive), "int8",
                                 pytest.param("fp8", marks=pytest.mark.exhaustive)])   # CI time: int8 by default
def test_a_requests_tokens_do_not_depend_on_its_batch_within_a_format(default_llm, fmt):
    """Alone in an ample pool, or batched with chunked prefill in a pool that preempts, with
    prefix-cache hits and with n-gram drafts: the same tokens up to the format's near-ties (a
    flip needs the alone run's top-2 gap under twice ``BATCH_SHIFT``), and each agreed token's
    log-probability within ``BATCH_SHIFT`` of the alone run's; every token the top of the
    logits its own run computed for it (a draft kept where the target chose otherwise is not)."""
    shared = default_llm.tokenizer.encode("A short story about a lighthouse keeper and the sea. ")
    prompts = [shared + default_llm.tokenizer.encode(t) for t in
               ("Once upon a time", "The storm came at night and", "She counted the ships",
                "In the morning the keeper")]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)

    def run(**sections) -> tuple[list, dict]:
        llm = LLM.from_config(sections)
        outs = llm.generate(prompts, params)
        assert llm.engine.kv.num_free_blocks == llm.num_blocks
        return outs, llm.report(outs)

    ample = LLM.from_config({"cache": {"dtype": fmt, "num_blocks": 128, "prefix_caching": False}})
    want = [ample.generate([p], params)[0] for p in prompts]
    tight, rep = run(cache={"dtype": fmt, "num_blocks": 20, "block_size": 4},
                     scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4})
    assert rep["preemptions"] > 0 and rep["prefix_cache_hit_rate"] > 0, rep
    drafted, _ = run(cache={"dtype": fmt, "num_blocks": 128, "block_size": 4},
                     speculative={"method": "ngram", "num_tokens": 3})
    shift = BATCH_SHIFT[fmt]
    for how, outs in (("batched", tight), ("drafted", drafted)):
        for i, (got, ref) in enumerate(zip(outs, want)):
            for t, (a, lp) in enumerate(zip(got.token_ids, got.logprobs)):   # greedy on its own logits
                assert lp[a] == max(lp.values()), (how, i, t, a, lp)
            assert_greedy_match(got.token_ids, ref.token_ids, logprob_gaps(ref), f"{how} {i}", tie=2 * shift)
            for t, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)):
                if a != b:
                    break
                assert abs(got.logprobs[t][a] - ref.logprobs[t][a]) < shift, (how, i, t)


def test_each_format_stays_close_to_the_float32_cache(default_llm, prose_ids):
    """Mean KL from the float32 cache's predictions over the same text: float16 and bfloat16
    tiny, int8 larger but small, and none zero (each format really rounds); int8's pool rows
    are 68 bytes a head against 128 in 16 bits."""
    kl = {}
    for fmt in ("float16", "bfloat16", "int8", "fp8"):
        llm = LLM.from_config({"cache": {"dtype": fmt, "num_blocks": 64}})
        kl[fmt] = kl_divergence(llm, default_llm, prose_ids)
        if fmt == "int8":
            assert llm.kv_cache.pool.shape[-1] * llm.kv_cache.pool.element_size() == 68
    assert 0 < kl["float16"] < kl["bfloat16"] < 2e-3, kl
    assert kl["float16"] < kl["int8"] < 1e-2, kl
    assert kl["int8"] < kl["fp8"] < 5e-2, kl          # 3 mantissa bits against q8_0's 7 and a scale


def test_backends_that_cannot_read_a_format_refuse_it_by_name(default_llm):
    with pytest.raises(ConfigError, match="cache.dtype: the onnxruntime backend reads K/V in float32, not int8"):
        LLM.from_config({"cache": {"dtype": "int8"}, "backend": {"name": "onnxruntime"}})
    with pytest.raises(ConfigError, match="the native backend reads K/V in float32, float16, bfloat16, "
                                          "int8, not fp8"):
        LLM.from_config({"cache": {"dtype": "fp8"}, "backend": {"name": "native"}, "model": {"quantization": "q4"}})
    with pytest.raises(ConfigError, match="runs of 32 values; this model's head_dim is 16"):
        tiny_llm(cache={"dtype": "int8"})


def test_auto_leaves_out_the_backends_that_cannot_read_the_format():
    from twophase.backends.registry import Registry
    from twophase.builder import routing
    from twophase.config import load_config

    cfg = load_config({"backend": {"name": "auto"}, "cache": {"dtype": "int8"}})
    chosen, left_out = routing.candidates(cfg, Registry())
    assert "torch" in chosen and "onnxruntime" not in chosen
    assert left_out["onnxruntime"] == "does not read K/V in int8"


def test_the_plan_holds_nearly_twice_the_tokens_at_8_bits():
    from twophase import plan as planner
    from twophase.config import load_config

    tokens = {}
    for fmt in ("bfloat16", "int8", "fp8"):
        cfg = load_config(None, {"model": {"name": "qwen3-8b", "weights": "random"}, "cache": {"dtype": fmt}})
        tokens[fmt] = planner.plan(cfg, planner.profile("h200")).kv_tokens
    assert 1.85 < tokens["int8"] / tokens["bfloat16"] < 1.9, tokens
    assert 1.99 < tokens["fp8"] / tokens["bfloat16"] < 2.01, tokens   # whole blocks round either way
