"""Adapters in PEFT's format against PEFT itself: tiny random-weight models of a family with
separate projections (Llama) and one with fused ones (Phi-3), random adapters PEFT builds and
saves, logits at every position within 1e-4 of ``PeftModel``; one batch mixing adapters and the
base model gives each sequence the logits it gets alone."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import tiny_hf_model
from helpers.lora import TARGETS as ALL
from helpers.lora import peft_adapter

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch
from twophase.lora.peft_adapter import AdapterError, load_peft_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = {"llama": (ALL["llama"], ["k_proj", "down_proj"]), "phi3": (ALL["phi3"], ["qkv_proj"])}


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.exhaustive), "phi3"])
def setup(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    tiny_hf_model(family, root / "base")
    llm = LLM.from_config({"model": {"path": str(root / "base")}, "cache": {"num_blocks": 64, "block_size": 8}})
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    refs = []
    for i, (targets, kw) in enumerate([(TARGETS[family][0], dict(r=4, lora_alpha=8)),
                                       (TARGETS[family][1], dict(r=2, lora_alpha=3, use_rslora=True))]):
        pm = peft_adapter(root / "base", root / f"a{i}", targets, seed=10 + i, **kw)
        with torch.no_grad():
            refs.append(pm(ids).logits[0])
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()
    with torch.no_grad():
        refs.append(base(ids).logits[0])
    model = llm.prefill_backend.model
    from twophase.models.families import by_model_type
    names = by_model_type(family, "test").layer_names
    adapters = [load_peft_adapter(f"a{i}", root / f"a{i}", model, names) for i in range(2)]
    for slot, a in enumerate(adapters):
        llm.prefill_backend.place_adapter(slot, a)
    return llm, ids[0].tolist(), refs, root, names


def _logits(llm, prompts: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
    """Each prompt's logits at every position, in one prefill call, sequence ``i`` with the
    adapter in slot ``slots[i]`` (-1: the base model)."""
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    for r, p in zip(reqs, prompts):
        assert eng.kv.allocate(r, len(p))
    batch = prefill_batch([(r, 0, len(p)) for r, p in zip(reqs, prompts)], eng.kv)
    batch.logits, batch.lora_slots = "all", slots
    try:
        out = llm.prefill_backend.prefill(batch)
    finally:
        for r in reqs:
            eng.abort(r.request_id)
    return list(out.split([len(p) for p in prompts]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_each_adapter_equals_peft_at_every_position(setup):
    llm, ids, refs, _, _ = setup
    for slot, ref in [(0, refs[0]), (1, refs[1]), (-1, refs[2])]:
        (got,) = _logits(llm, [ids], [slot])
        assert _rel(got, ref) < 1e-4, f"slot {slot}"
    assert _rel(refs[0], refs[2]) > 1e-2 and _rel(refs[1], refs[2]) > 1e-2     # the adapters matter


def test_a_batch_mixing_adapters_gives_each_sequence_its_own(setup):
    llm, ids, refs, _, _ = setup
    prompts = [ids, ids[:25], ids, ids[:33]]
    slots = [1, -1, 0, 1]
    for got, slot, p in zip(_logits(llm, prompts, slots), slots, prompts):
        assert _rel(got, refs[{0: 0, 1: 1, -1: 2}[slot]][:len(p)]) < 1e-4, f"slot {slot}"


def test_bad_adapters_are_refused_with_the_reason(setup, tmp_path):
    llm, ids, refs, root, names = setup
    model = llm.prefill_backend.model
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(root / "a0", bad)
    data = (bad / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(AdapterError, match="cannot be read"):
        load_peft_adapter("bad", bad, model, names)
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_peft_adapter("bad", bad, model, names)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter("bad", tmp_path, model, names)
    cfg = (root / "a0" / "adapter_config.json").read_text()
    shutil.copy(root / "a0" / "adapter_model.safetensors", bad)
    for key, value, why in [('"r": 4', '"r": 0', "rank r must be a positive integer"),
                            ('"use_dora": false', '"use_dora": true', "DoRA")]:
        assert key in cfg, key
        (bad / "adapter_config.json").write_text(cfg.replace(key, value))
        with pytest.raises(AdapterError, match=why):
            load_peft_adapter("bad", bad, model, names)
    from safetensors.torch import load_file, save_file
    (bad / "adapter_config.json").write_text(cfg)
    tensors = load_file(root / "a0" / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    for change, why in [({key: torch.zeros(4, 7)}, "not this model's shapes"),
                        ({key.replace("layers.0", "layers.9"): tensors[key].clone(),
                          key.replace("layers.0", "layers.9").replace("lora_A", "lora_B"):
                          tensors[key.replace("lora_A", "lora_B")].clone()}, "the model has 3 layers"),
                        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "the head")]:
        save_file({**tensors, **change}, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=why):
            load_peft_adapter("bad", bad, model, names)
