"""Chat templates are rendered in jinja2's sandbox, as HF renders them: a model's template is
code from a download, and may not reach Python's internals."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import SecurityError

from twophase.models.tokenizer import HFTokenizer


def _folder(tmp_path, template: str):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


def test_a_template_renders_messages(tmp_path):
    tok = HFTokenizer(_folder(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
    assert tok.max_token_chars == len("[UNK]")


def test_a_template_cannot_reach_python_internals(tmp_path):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok = HFTokenizer(_folder(tmp_path, evil))
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
