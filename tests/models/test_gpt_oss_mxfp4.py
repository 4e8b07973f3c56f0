"""gpt-oss as published: its experts' matrices in MXFP4 (``*_blocks`` and ``*_scales``, the
config's ``quantization_config`` saying ``mxfp4``), read into their float form and checked
against transformers' own dequantisation (``integrations.mxfp4.convert_moe_packed_tensors``) of
the same blocks, loaded into transformers' model."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_models import tiny_hf_model

from twophase import LLM
from twophase.core.batch import prefill_batch
from twophase.errors import ModelError
from twophase.models.families.gpt_oss import mxfp4_dequantize

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _random_mxfp4(E: int, rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[E, rows, cols / 32, 16]`` of random codes (every one of the 16, -0 included)
    under scales from 2^-6 to 2^0 (E8M0 121..127)."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 128, (E, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny gpt-oss saved as the published checkpoints are (experts in MXFP4, the rest as is),
    and transformers' model holding transformers' dequantisation of those experts."""
    from safetensors.torch import save_file

    plain = tmp_path_factory.mktemp("gpt_oss")
    ref = tiny_hf_model("gpt_oss", plain)
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    g = torch.Generator().manual_seed(3)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    for i, layer in enumerate(ref.model.layers):
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)                                     # [E, in, out]
            blocks, scales = _random_mxfp4(p.shape[0], p.shape[2], p.shape[1], g)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del sd[key]
            sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
            with torch.no_grad():
                p.copy_(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(sd, str(folder / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, ref


def test_the_blocks_read_as_transformers_reads_them():
    g = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(3, 8, 64, g)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)      # [E, cols, rows]
    assert torch.equal(mxfp4_dequantize(blocks, scales, torch.float32).transpose(1, 2), want)
    assert torch.equal(mxfp4_dequantize(blocks, scales).float(), mxfp4_dequantize(blocks, scales, torch.float32))


def test_an_mxfp4_checkpoint_gives_transformers_logits_on_its_dequantised_experts(published):
    folder, ref = published
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 32, "block_size": 8}})
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]
    eng = llm.engine
    req = eng.add_request(ids[0].tolist(), __import__("twophase").SamplingParams(max_tokens=1))
    assert eng.kv.allocate(req, 40)
    batch = prefill_batch([(req, 0, 40)], eng.kv)
    batch.logits = "all"
    got = llm.prefill_backend.prefill(batch)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    # the float weights other backends read (without building the model) are the same experts
    from twophase.models.state_dict import float_weights

    experts = float_weights(llm.model, lambda k: ".experts_" in k)
    assert len(experts) == 4 * len(ref.model.layers)
    held = llm.prefill_backend.model.state_dict()
    assert all(torch.equal(v, held[k].float()) for k, v in experts.items())


def test_a_quantization_not_read_is_named_and_a_lone_half_of_a_pair(published, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = published
    config = json.loads((folder / "config.json").read_text())
    other = {**config, "quantization_config": {"quant_method": "bitsandbytes"}}
    (tmp_path / "config.json").write_text(json.dumps(other))
    save_file(load_file(str(folder / "model.safetensors")), str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="quantized with 'bitsandbytes' are not read here"):
        LLM.from_config({"model": {"path": str(tmp_path)}})
    (tmp_path / "config.json").write_text(json.dumps(config))
    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match="down_proj_blocks has no .*down_proj_scales beside it"):
        LLM.from_config({"model": {"path": str(tmp_path)}})


def test_only_the_tensors_asked_for_are_read_and_unpacked(published, monkeypatch):
    """A reader asking for the norms (native's float tensors) reads no expert's blocks: each
    tensor is read, and dequantised, only when taken."""
    from twophase.models import state_dict

    folder, _ = published
    llm = LLM.from_config({"model": {"path": str(folder)}, "cache": {"num_blocks": 16}})
    read = []
    real = state_dict._read_tensor
    monkeypatch.setattr(state_dict, "_read_tensor", lambda path, name: read.append(name) or real(path, name))
    norms = state_dict.float_weights(llm.model, lambda k: k.endswith("norm.weight"))
    assert norms and read and all(n.endswith("norm.weight") for n in read)


def test_a_lone_half_of_a_pair_or_a_nan_scale_is_named():
    from twophase.models.families.gpt_oss import unpack_mxfp4

    blocks, scales = _random_mxfp4(2, 4, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ModelError, match="x_scales has no x_blocks beside it"):
        unpack_mxfp4({"x_scales": scales})
    scales[1, 2, 0] = 255
    with pytest.raises(ModelError, match="x_scales holds 255, E8M0's NaN"):
        unpack_mxfp4({"x_blocks": blocks, "x_scales": scales})["x"]
