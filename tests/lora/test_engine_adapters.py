"""Adapters through the whole engine: ``[[lora]]`` in the config, requests naming theirs in
``SamplingParams.lora``; greedy tokens equal PEFT's ``generate``, one batch mixing adapters
and the base model gives each its own, the prefix cache never lends one adapter's blocks to
another, and fewer slots than adapters only makes requests wait."""

from __future__ import annotations

import pytest
from helpers.lora import PROMPTS, TOKENS

from twophase import LLM, SamplingParams
from twophase.errors import ConfigError, RequestRejected

peft = pytest.importorskip("peft")


def _llm(root, **cfg):
    return LLM.from_config({"model": {"path": str(root / "base"), **cfg.pop("model", {})},
                            "cache": {"num_blocks": 64, "block_size": 8},
                            "lora": [{"name": f"a{i}", "path": str(root / f"a{i}")} for i in range(3)], **cfg})


def _params(name):
    return SamplingParams(max_tokens=TOKENS, ignore_eos=True, lora=name)


def test_mixed_batches_give_each_request_its_adapters_tokens(folders):
    root, refs = folders
    llm = _llm(root)
    names = [None, "a0", "a1", "a2"]
    prompts = [p for p in PROMPTS for _ in names]
    params = [_params(n) for _ in PROMPTS for n in names]
    outs = llm.generate(prompts, params)
    for o, p in zip(outs, params):
        assert o.token_ids == refs[p.lora][PROMPTS.index(o.prompt_token_ids)], p.lora
    # the same again: prefix hits, each within its own adapter's blocks only
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.metrics["num_cached_tokens"] > 0 for o in again)
    assert llm.engine.kv.num_used_blocks == 0 or llm.engine.kv.pool.num_free == llm.num_blocks


def test_an_adapters_cached_prefix_is_never_anothers(folders):
    root, refs = folders
    llm = _llm(root)
    llm.generate([PROMPTS[2]], _params("a0"))
    other = llm.generate([PROMPTS[2]], _params("a1"))[0]
    base = llm.generate([PROMPTS[2]], _params(None))[0]
    same = llm.generate([PROMPTS[2]], _params("a0"))[0]
    assert other.metrics["num_cached_tokens"] == 0 and base.metrics["num_cached_tokens"] == 0
    assert same.metrics["num_cached_tokens"] == 32
    assert other.token_ids == refs["a1"][2] and base.token_ids == refs[None][2]


def test_fewer_slots_than_adapters_only_make_requests_wait(folders):
    root, refs = folders
    llm = _llm(root, model={"max_loras": 1})
    names = ["a0", "a1", None, "a2", "a0"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = llm.generate(prompts, [_params(n) for n in names])
    for o, n, p in zip(outs, names, prompts):
        assert o.token_ids == refs[n][PROMPTS.index(p)], n
    assert llm.adapters.stats["a0"].loads == 2 and llm.adapters.resident == ["a0"]


def test_preempted_requests_keep_their_adapter(folders):
    root, refs = folders
    llm = _llm(root, cache={"num_blocks": 12, "block_size": 8},
               scheduler={"max_num_seqs": 6, "max_num_batched_tokens": 40, "admission": "greedy"})
    names = ["a0", "a1", None, "a2", "a0", "a1"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = llm.generate(prompts, [_params(n) for n in names])
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for o, n, p in zip(outs, names, prompts):
        assert o.token_ids == refs[n][PROMPTS.index(p)], n


def test_unknown_adapters_and_backends_without_them_are_refused(folders, tmp_path):
    root, _ = folders
    llm = _llm(root)
    with pytest.raises(RequestRejected, match="no adapter named 'zz'.*a0, a1, a2"):
        llm.engine.add_request(PROMPTS[0], _params("zz"))
    with pytest.raises(ConfigError, match="lora\\[0\\].*no adapter_config.json"):
        LLM.from_config({"model": {"path": str(root / "base")}, "lora": [{"name": "x", "path": str(tmp_path)}]})
    with pytest.raises(ConfigError, match="lora\\[1\\].name.*twice"):
        LLM.from_config({"model": {"path": str(root / "base")},
                         "lora": [{"name": "x", "path": "a"}, {"name": "x", "path": "b"}]})


@pytest.mark.exhaustive
def test_speculative_decoding_with_adapters_stays_exact(folders):
    """Drafts are verified by the target with each request's adapter: its tokens, whatever the
    drafts (n-gram lookups in the prompt and output)."""
    root, refs = folders
    llm = _llm(root, speculative={"method": "ngram", "num_tokens": 3})
    names = ["a0", None, "a1", "a2"]
    outs = llm.generate([PROMPTS[1]] * 4, [_params(n) for n in names])
    assert [o.token_ids for o in outs] == [refs[n][1] for n in names]
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0


@pytest.mark.exhaustive
def test_the_plan_counts_the_resident_adapters_bytes(folders):
    from twophase.config import load_config
    from twophase.plan.budget import adapter_item

    root, _ = folders
    llm = _llm(root, model={"max_loras": 2})
    held = sorted((llm.adapters._resident[n].adapter.nbytes for n in llm.adapters.resident), reverse=True)
    cfg = load_config({"model": {"path": str(root / "base"), "max_loras": 2},
                       "lora": [{"name": f"a{i}", "path": str(root / f"a{i}")} for i in range(3)]})
    sizes = sorted((llm.adapters.loader(f"a{i}", root / f"a{i}").nbytes for i in range(3)), reverse=True)
    item = adapter_item(cfg)
    assert item.bytes == sum(sizes[:2]) and item.kind == "adapters"
    assert len(held) == 2 and held[0] <= sizes[0]
