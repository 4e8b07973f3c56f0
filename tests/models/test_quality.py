"""``quality.compare`` gives, from one pass of each model, what ``perplexity`` of each and
``kl_divergence`` give from three."""

from __future__ import annotations

import pytest
from helpers.models import random_prompts, tiny_llm

from twophase.measure.quality import compare, kl_divergence, perplexity


def test_one_pass_gives_both_perplexities_and_the_kl():
    ids = random_prompts(1, seed=3, longest=200)[0] * 3
    ref = tiny_llm(scheduler={"max_num_batched_tokens": 96})
    other = tiny_llm(model={"seed": 1}, scheduler={"max_num_batched_tokens": 96})
    ppl, ref_ppl, kl = compare(other, ref, ids)
    assert ppl == pytest.approx(perplexity(other, ids), rel=1e-5)
    assert ref_ppl == pytest.approx(perplexity(ref, ids), rel=1e-5)
    assert kl == pytest.approx(kl_divergence(other, ref, ids), rel=1e-5) and kl > 0.01
