"""The loaders that keep a GGUF's blocks (q4, native) read the file the model's ``WeightSource``
names, never one found through the float cache (the HF folder the file is dequantised into for
the float loaders); and the native backend takes its norms and embedding from the source by the
family's name table, without building the float model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from twophase.contract import WeightSource

ROOT = Path(__file__).resolve().parents[2] / "twophase"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    import torch
    import transformers
    from helpers.gguf_writer import write_gguf

    folder = tmp_path_factory.mktemp("source")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "hf")
    types = {f"blk.{i}.{t}.weight": "Q4_1" for i in range(2)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    return write_gguf(folder / "hf", folder / "model.gguf", {**types, "output.weight": "Q8_0"})


def _specs(gguf: Path, quantization: str, tmp_path: Path):
    """The spec the loader makes for ``gguf``, and the same model whose float cache is a copy
    without the cache's stamp (``source.json``), so the file can only come from the source."""
    from twophase.config import load_config
    from twophase.models import loader

    src = load_config(None, {"model": {"path": str(gguf), "quantization": quantization}}).model.source()
    spec = loader.model_spec(loader.resolve(src, "cpu"), src)
    assert spec.source == WeightSource("gguf", gguf, float_cache=spec.source.float_cache)
    assert (spec.source.float_cache / "source.json").exists()
    bare = tmp_path / "float-cache"
    bare.mkdir()
    for f in spec.source.float_cache.iterdir():
        if f.name != "source.json":
            (bare / f.name).symlink_to(f)
    source = WeightSource("gguf", gguf, float_cache=bare)
    return spec, dataclasses.replace(spec, weights=source.weights, source=source)


def _packed(pack, spec, folder: Path) -> dict[str, np.ndarray]:
    folder.mkdir()
    pack(spec, folder)
    return {f.name: np.load(f) for f in sorted(folder.glob("*.npy"))}


def test_native_gguf_reads_the_file_the_source_names(tiny_gguf, tmp_path, monkeypatch):
    """``quantization = "gguf"`` packs the same arrays whether or not the float cache carries
    the stamp, and never builds the float model (its norms and embedding come by name)."""
    from twophase.backends.native import stored_weights
    from twophase.models import state_dict

    spec, bare = _specs(tiny_gguf, "gguf", tmp_path)
    want = _packed(stored_weights.pack, spec, tmp_path / "with-stamp")

    def no_float_model(*a, **k):
        raise AssertionError("the float model was built")

    monkeypatch.setattr(state_dict, "build_model", no_float_model)
    got = _packed(stored_weights.pack, bare, tmp_path / "without-stamp")
    assert got.keys() == want.keys() and {"embed.npy", "attn_norm.npy", "final_norm.npy"} <= got.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_q4_takes_the_files_blocks_from_the_source(tiny_gguf, tmp_path, monkeypatch):
    """``quantization = "q4"`` on native takes the GGUF's own blocks by the source (not the
    float cache requantised), and without outlier channels builds no float model."""
    from twophase.backends.native import model_struct as native_weights
    from twophase.models import q4_weights, state_dict

    spec, bare = _specs(tiny_gguf, "q4", tmp_path)
    want = _packed(native_weights.pack, spec, tmp_path / "with-stamp")
    read = []
    real = q4_weights.gguf_qweights
    monkeypatch.setattr(q4_weights, "gguf_qweights", lambda path, arch: read.append(path) or real(path, arch))
    got = _packed(native_weights.pack, bare, tmp_path / "without-stamp")
    assert read == [tiny_gguf]
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert native_weights.manifest(bare)["from_gguf"]

    def no_float_model(*a, **k):
        raise AssertionError("the float model was built")

    monkeypatch.setattr(state_dict, "build_model", no_float_model)
    _packed(native_weights.pack, dataclasses.replace(bare, outlier_channels=0), tmp_path / "no-outliers")


def test_no_module_finds_weights_through_the_float_caches_stamp():
    """Only the loader that keeps the float cache reads its stamp (the cache's key)."""
    readers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "source.json" in p.read_text())
    assert readers == ["models/loader.py"]


def test_a_spec_replaced_field_by_field_keeps_its_source_in_agreement(tmp_path):
    """``weights`` and ``seed``, which plugins read and older code replaces, never disagree with
    the source: a source they no longer match gives way to what they name."""
    import torch

    from twophase.contract import ModelSpec
    from twophase.models.shapes import named_shape

    arch = named_shape("tiny")
    spec = ModelSpec(arch, "random", torch.float32, "tiny")
    assert spec.source == WeightSource("random", seed=0)
    assert dataclasses.replace(spec, seed=1).source == WeightSource("random", seed=1)
    assert dataclasses.replace(spec, weights=str(tmp_path)).source == WeightSource("folder", tmp_path)
    gguf = WeightSource("gguf", tmp_path / "m.gguf", float_cache=tmp_path / "cache")
    kept = dataclasses.replace(spec, weights=gguf.weights, source=gguf)
    assert kept.source == gguf and kept.weights == str(tmp_path / "cache")
    assert dataclasses.replace(kept, weights=str(tmp_path)).source == WeightSource("folder", tmp_path)
