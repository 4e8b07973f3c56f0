"""A tiny Llama and three PEFT adapters over it, shared by the adapter tests."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import tiny_hf_model
from helpers.lora import PROMPTS, TARGETS, TOKENS, peft_adapter


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """A tiny Llama, three adapters, and each one's (and the base's) greedy tokens per prompt."""
    root = tmp_path_factory.mktemp("lora-engine")
    base = tiny_hf_model("llama", root / "base")
    refs = {None: _greedy(base)}
    for i, (targets, kw) in enumerate([(TARGETS["llama"], dict(r=4, lora_alpha=8)),
                                       (["q_proj", "v_proj"], dict(r=8, lora_alpha=4)),
                                       (["o_proj", "down_proj"], dict(r=2, lora_alpha=2, use_rslora=True))]):
        refs[f"a{i}"] = _greedy(peft_adapter(root / "base", root / f"a{i}", targets, seed=20 + i, **kw))
    assert len({tuple(map(tuple, r)) for r in refs.values()}) == 4      # each adapter changes the tokens
    return root, refs


def _greedy(model) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                               do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


