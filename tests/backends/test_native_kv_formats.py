"""The native step over a pool of each K/V format (``cache.dtype``), on the default model's GGUF
blocks: the rows it writes are, byte for byte, what ``twophase.kv_formats`` encodes (itself
checked against the ``gguf`` package's q8_0), its logits over them follow the torch model's over
the same format, and batching, chunks and preemption change no token."""

from __future__ import annotations

import pytest
import torch
from helpers.models import prefill_all_logits
from helpers.native import native_or_skip

from twophase import LLM, SamplingParams
from twophase.kv_formats import kv_format

FORMATS = ["float16", "bfloat16", "int8"]
PROMPTS = [[(7 * i + 3 * j) % 4000 + 100 for j in range(40 + 9 * i)] for i in range(3)]


@pytest.fixture(autouse=True)
def _needs_native():
    native_or_skip()


def _llm(fmt: str, native: bool = True, backend: dict | None = None, **sections) -> LLM:
    cfg: dict = {"cache": {"dtype": fmt, "num_blocks": 64, "block_size": 16}, **sections}
    if native:
        cfg |= {"model": {"quantization": "q4"}, "backend": backend or {"name": "native"}}
    return LLM.from_config(cfg)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_rows_native_writes_are_the_formats_encoding(fmt):
    """Layer 0's K/V do not depend on the cache (nothing before them read it): the pool of
    ``fmt`` holds exactly ``encode`` of the float32 pool's rows."""
    plain, packed = _llm("float32"), _llm(fmt)
    prefill_all_logits(plain, PROMPTS), prefill_all_logits(packed, PROMPTS)
    want = kv_format(fmt).encode(plain.kv_cache.pool[0])
    got = packed.kv_cache.pool[0]
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_logits_over_each_format_follow_torchs(fmt):
    """The same file's weights on torch (float32, dequantised) over a pool of the same format:
    the mean KL between their predictions stays what the native step's int8 activations cost
    over a float32 pool (measured: 0.0036 there; 0.0036 float16, 0.0035 bfloat16, 0.0046 int8);
    reading the rows wrongly (a scale, a half-word) costs far more."""
    got = prefill_all_logits(_llm(fmt), PROMPTS)
    want = prefill_all_logits(_llm(fmt, native=False), PROMPTS)
    ref, lp = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert kl < 0.006, f"{fmt}: mean KL {kl:.4f} from torch over the same format"


def test_batching_chunking_and_preemption_change_no_token_at_8_bits():
    """On the vector paths (``amx = false``: where the CPU has AMX, a chunk of 24 rows or more
    attends on the bf16 tiles instead, other bits than a shorter chunk's) each token is computed
    on its own, so neither its neighbours in a batch nor where its prompt was cut change it."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    vector = {"name": "native", "options": {"amx": False}}
    alone = _llm("int8", backend=vector)
    want = [alone.generate([p], params)[0].token_ids for p in PROMPTS]
    tight = _llm("int8", backend=vector, cache={"dtype": "int8", "num_blocks": 10, "block_size": 8},
                 scheduler={"max_num_batched_tokens": 24, "max_num_seqs": 3})
    outs = tight.generate(PROMPTS, params)
    assert tight.report(outs)["preemptions"] > 0
    assert [o.token_ids for o in outs] == want
