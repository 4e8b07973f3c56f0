"""The key fingerprint: every part that changes the K/V changes the fingerprint, and a salt or a
fingerprint changes the chain's root."""

from __future__ import annotations

import pytest
import torch

from twophase.cache.fingerprint import REQUIRED_PARTS, cache_fingerprint, model_identity, root_hash

BASE: dict[str, object] = {
    "model": {"files": [["model.safetensors", 269060552]], "config_sha256": "ab" * 32},
    "weights_format": "bfloat16",
    "kv_format": "float16",
    "block_size": 16,
    "layout": {"layers": 30, "kv_heads": 3, "head_dim": 64, "groups": [[None, 30]]},
    "tokenizer": "cd" * 32,
    "adapter": None,
}


def test_a_fingerprint_is_32_bytes_and_does_not_depend_on_argument_order():
    fp = cache_fingerprint(**BASE)
    assert len(fp) == 32
    assert cache_fingerprint(**dict(reversed(list(BASE.items())))) == fp
    assert cache_fingerprint(**{**BASE, "layout": dict(reversed(list(BASE["layout"].items())))}) == fp


@pytest.mark.parametrize("part, other", [
    ("model", {"files": [["model.safetensors", 269060553]], "config_sha256": "ab" * 32}),
    ("weights_format", "q4_0"),
    ("kv_format", "int8"),
    ("block_size", 32),
    ("layout", {"layers": 30, "kv_heads": 3, "head_dim": 64, "groups": [[4096, 30]]}),
    ("tokenizer", "ce" * 32),
    ("adapter", "sql-lora"),
])
def test_each_part_changes_the_fingerprint(part, other):
    assert cache_fingerprint(**{**BASE, part: other}) != cache_fingerprint(**BASE)


def test_an_extra_part_changes_it_and_a_missing_one_is_refused_by_name():
    assert cache_fingerprint(**BASE, rope_scaling=2.0) != cache_fingerprint(**BASE)
    for part in REQUIRED_PARTS:
        parts = {k: v for k, v in BASE.items() if k != part}
        with pytest.raises(ValueError, match=part):
            cache_fingerprint(**parts)


def test_values_without_one_json_form_are_refused():
    with pytest.raises(TypeError, match="kv_format"):
        cache_fingerprint(**{**BASE, "kv_format": torch.float16})
    with pytest.raises(TypeError, match="layout"):
        cache_fingerprint(**{**BASE, "layout": {1: 2}})
    with pytest.raises(ValueError, match="finite"):
        cache_fingerprint(**{**BASE, "layout": [float("nan")]})


def test_the_root_depends_on_the_fingerprint_and_the_salt():
    fp = cache_fingerprint(**BASE)
    other = cache_fingerprint(**{**BASE, "adapter": "x"})
    roots = {root_hash(fp), root_hash(fp, ""), root_hash(fp, "tenant-a"), root_hash(fp, "tenant-b"),
             root_hash(other), root_hash(other, "tenant-a")}
    assert len(roots) == 6 and all(len(r) == 32 for r in roots)
    assert root_hash(fp, "tenant-a") == root_hash(fp, "tenant-a")
    with pytest.raises(ValueError, match="32 bytes"):
        root_hash(fp[:16])


def test_model_identity_follows_the_config_and_the_weights_sizes(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "README.md").write_text("not a weight")
    first = model_identity(tmp_path)
    assert first["files"] == [["model.safetensors", 100]]
    assert model_identity(tmp_path) == first
    (tmp_path / "README.md").write_text("edited")
    assert model_identity(tmp_path) == first
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    second = model_identity(tmp_path)
    assert second != first
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 101)
    assert model_identity(tmp_path) != second

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\1" * 50)
    one = model_identity(gguf)
    gguf.write_bytes(b"GGUF" + b"\2" * 50)
    assert model_identity(gguf) != one and one["file"] == "m.gguf" and one["bytes"] == 54
