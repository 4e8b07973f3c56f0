"""``model.name = "org/repo[:QUANT]"`` through huggingface_hub, on an HF cache this test lays
out (this machine reaches no hub; a real download is untested, see docs/untested.md)."""

from __future__ import annotations

import pytest
from helpers.hf_models import tiny_hf_model

from twophase import LLM, SamplingParams
from twophase.errors import ModelError
from twophase.models import hf_repo, hub

SHA = "0123456789abcdef0123456789abcdef01234567"


def _repo(cache, name: str, files: dict):
    """An HF cache entry of ``name`` at revision main: ``files`` (name -> a path to link)."""
    top = cache / f"models--{name.replace('/', '--')}"
    snap = top / "snapshots" / SHA
    snap.mkdir(parents=True)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(SHA)
    for fname, src in files.items():
        (snap / fname).symlink_to(src)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_a_safetensors_repository_loads_from_the_cache(hf_cache, tmp_path):
    src = tmp_path / "src"
    ref = tiny_hf_model("qwen3", src)
    _repo(hf_cache, "acme/tiny-qwen3", {f.name: f for f in src.iterdir()})
    llm = LLM.from_config({"model": {"name": "acme/tiny-qwen3"}, "cache": {"num_blocks": 32}})
    assert llm.model.model_id == "acme/tiny-qwen3" and llm.model.arch.family == "qwen3"
    from twophase.plan.model_source import planned_model

    assert planned_model(llm.config.model).arch == llm.model.arch      # the planner reads the same
    import torch

    prompt = list(range(5, 25))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert out == g[0, len(prompt):].tolist()


def test_a_gguf_repository_takes_a_quant_tag(hf_cache):
    gguf = hub.gguf_path(hub.DEFAULT_MODEL)
    snap = _repo(hf_cache, "acme/tiny-GGUF", {"tiny-Q4_1.gguf": gguf, "tiny-Q8_0.gguf": gguf})
    assert hf_repo.resolve("acme/tiny-GGUF:Q8_0") == snap / "tiny-Q8_0.gguf"
    assert hf_repo.resolve("acme/tiny-GGUF:q4_1") == snap / "tiny-Q4_1.gguf"
    with pytest.raises(ModelError, match=r"no .gguf file tagged 'Q4_K_M'; its tags: Q4_1, Q8_0"):
        hf_repo.resolve("acme/tiny-GGUF:Q4_K_M")
    with pytest.raises(ModelError, match=r"several GGUF files: name one by its quant tag, e.g. acme/tiny-GGUF:Q4_1"):
        hf_repo.resolve("acme/tiny-GGUF")
    # a vision projector is not the model; a tag matches whole (F16 is not BF16's)
    snap = _repo(hf_cache, "acme/vl-GGUF", {"vl-BF16.gguf": gguf, "mmproj-F16.gguf": gguf})
    assert hf_repo.resolve("acme/vl-GGUF") == snap / "vl-BF16.gguf"
    with pytest.raises(ModelError, match="no .gguf file tagged 'F16'; its tags: BF16"):
        hf_repo.resolve("acme/vl-GGUF:F16")


def test_a_cache_holding_only_the_config_says_the_weights_are_missing(hf_cache, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    _repo(hf_cache, "acme/planned", {"config.json": tmp_path / "config.json"})
    with pytest.raises(ModelError, match="cache holds config.json of it, not its weights"):
        LLM.from_config({"model": {"name": "acme/planned"}})


def test_offline_and_not_cached_is_a_clear_error(hf_cache):
    with pytest.raises(ModelError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        LLM.from_config({"model": {"name": "acme/missing"}})
