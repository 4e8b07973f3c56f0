"""Every family served as the engine serves: several prompts longer and shorter than the sliding
windows in one batch, prefilled in chunks of a small budget, preempted and recomputed in a tight
pool, with prefix-cache hits, and with speculative drafts; each gives the tokens it gives alone
in an ample pool (transformers' own, which ``test_families`` checks)."""

from __future__ import annotations

import pytest
from helpers.hf_models import FAMILIES, tiny_hf_model

from twophase import LLM, SamplingParams

pytest.importorskip("transformers")

SHARED = [(7 * i) % 290 + 5 for i in range(16)]          # a common prefix: prefix-cache hits
PROMPTS = [SHARED + [(13 * i + 5 * j) % 290 + 5 for j in range(n)] for i, n in enumerate((54, 3, 25, 17, 40))]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
BUDGET = 24                                             # tokens a step: prompts prefill in chunks


# DeepSeek V3's latent cache is served in the default lane; V2 (its routing) with -m exhaustive
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.exhaustive) if f == "deepseek_v2" else f
                                        for f in FAMILIES])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_hf_model(request.param, folder)
    return folder


def _llm(folder, num_blocks: int, **sections) -> LLM:
    return LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": num_blocks, "block_size": 4},
                            **sections})


def test_batched_chunked_preempted_and_drafted_tokens_are_each_prompts_own(folder):
    ample = _llm(folder, 512, cache={"num_blocks": 512, "block_size": 4, "prefix_caching": False})
    alone = [ample.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    longest = max(len(p) for p in PROMPTS) + PARAMS.max_tokens
    tight = ample.engine.kv.peak_blocks(longest, BUDGET) + 2 * ample.engine.kv.num_groups
    llm = _llm(folder, tight, scheduler={"max_num_batched_tokens": BUDGET, "max_num_seqs": 5})
    outs = llm.generate(PROMPTS, PARAMS)
    rep = llm.report(outs)
    assert [o.token_ids for o in outs] == alone
    assert rep["preemptions"] > 0 and rep["prefix_cache_hit_rate"] > 0, rep
    assert llm.engine.kv.num_free_blocks == llm.num_blocks
    drafted = _llm(folder, 512, speculative={"method": "ngram", "num_tokens": 3}).generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in drafted] == alone
