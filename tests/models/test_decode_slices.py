"""A decode batch whose padded K/V would be too large is attended a slice of sequences at a
time, with the same results as all at once."""

from __future__ import annotations

import torch
from helpers.models import random_prompts, tiny_llm

from twophase import SamplingParams
from twophase.models.layers import attention


def _decode_logits(llm, prompts):
    """Logits of one decode step of every prompt together (after their prefills)."""
    got = []
    backend = llm.decode_backend
    decode = backend.decode

    def keep(batch):
        out = decode(batch)
        if len(batch.token_ids) == len(prompts):
            got.append(out.clone())
        return out

    backend.decode = keep
    try:
        llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        backend.decode = decode
    return torch.cat(got)


def test_sliced_decode_equals_the_whole_batch(monkeypatch):
    prompts = random_prompts(9, seed=3, longest=60)
    whole = _decode_logits(tiny_llm(), prompts)
    rows = []
    real = attention.decode_rows
    monkeypatch.setattr(attention, "DECODE_GATHER_BYTES", 2 * 64 * 2 * 16 * 4 * 2)   # two rows of 64 tokens
    monkeypatch.setattr(attention, "decode_rows", lambda *a: rows.append(real(*a)) or rows[-1])
    sliced = _decode_logits(tiny_llm(), prompts)
    assert rows and max(rows) < len(prompts), rows           # the batch was cut
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6)
