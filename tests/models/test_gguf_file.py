"""The GGUF header reader against the ``gguf`` package's own reader: the same metadata, tensor
table and bytes, on a file ``gguf.GGUFWriter`` writes and on the default model's file; and a
plan or q4 load that never builds ``gguf.GGUFReader`` (it walks the whole vocabulary)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from twophase.errors import ModelError
from twophase.models import hub
from twophase.models.gguf_file import SHORT_ARRAY, GGUFFile, LongArray


def _same_as_the_package(path) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        want = ref.fields[key].contents()
        got = ours.metadata[key]
        if isinstance(got, LongArray):
            assert len(want) == len(got) > SHORT_ARRAY, key
        else:
            assert got == want, key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.ggml_type, mine.dims, mine.offset, mine.n_bytes) == (
            int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes), t.name
        got = ours.data(t.name)
        assert got.dtype == t.data.dtype and got.shape == t.data.shape, t.name
        assert np.array_equal(got, t.data), t.name


def test_a_written_file_reads_as_the_package_reads_it(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_bool("x.flag", True)
    w.add_int64("x.big", -(2 ** 40))
    w.add_string("x.name", "naïve ünïcode")
    w.add_array("x.short", [1, 2, 3])
    w.add_array("x.strings", ["a", "bb", ""])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(SHORT_ARRAY + 5)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(SHORT_ARRAY + 1)])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((5, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_the_package(path)
    meta = GGUFFile(path).metadata
    assert meta["x.short"] == [1, 2, 3] and meta["x.strings"] == ["a", "bb", ""]
    assert meta["tokenizer.ggml.tokens"] == LongArray(8, SHORT_ARRAY + 5)


def test_a_file_that_is_not_a_whole_gguf_is_a_model_error(tmp_path):
    path = tmp_path / "bad.gguf"
    for content in (b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00" + b"\x01" * 8):
        path.write_bytes(content)
        with pytest.raises(ModelError, match="not a readable GGUF"):
            GGUFFile(path)


@pytest.mark.slow
def test_the_default_models_file_reads_as_the_package_reads_it():
    _same_as_the_package(hub.gguf_path(hub.DEFAULT_MODEL))


@pytest.mark.slow
def test_planning_and_q4_loading_never_walk_the_whole_header(monkeypatch):
    from twophase.config import load_config
    from twophase.models.q4_weights import gguf_qweights
    from twophase.plan.model_source import planned_model

    path = hub.gguf_path(hub.DEFAULT_MODEL)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("built gguf.GGUFReader"))
    planned = planned_model(load_config({"model": {"name": hub.DEFAULT_MODEL}}).model)
    assert planned.source.endswith("header") and planned.arch.vocab_size == 49152
    weights = gguf_qweights(path, planned.arch)
    assert weights["lm_head.weight"].shape == (49152, planned.arch.hidden_size)
