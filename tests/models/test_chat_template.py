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


# Templates written the way the families' own are: Gemma's folds the system turn into the first
# user turn and raises on roles out of order; Llama 3.1's dates the prompt and lists tools as
# JSON; Qwen's walks the messages backwards with a namespace and loop controls.
GEMMA_LIKE = """{{ bos_token }}{% if messages[0].role == 'system' %}{% set first = messages[0].content + '\\n\\n' %}\
{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}\
{% for m in rest %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ (first if loop.first else '') + m.content | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""
LLAMA31_LIKE = """<|start_header_id|>system<|end_header_id|>
Today Date: {{ strftime_now('%d %b %Y') }}
{% if tools %}{% for t in tools %}{{ t | tojson(indent=4) }}
{% endfor %}{% endif %}<|eot_id|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""
QWEN_LIKE = """{%- set ns = namespace(last_user=-1) %}{%- for m in messages[::-1] %}{%- if m.role == 'user' %}\
{%- set ns.last_user = messages | length - 1 - loop.index0 %}{%- break %}{%- endif %}{%- endfor %}\
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}\
{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 < ns.last_user %}{% continue %}{% endif %}\
<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "the weather in a town",
          "parameters": {"type": "object", "properties": {"town": {"type": "string"}}}}}]
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Zürich ?"},
        {"role": "assistant", "content": "In Switzerland."}, {"role": "user", "content": "  And Bern?  "}]


@pytest.mark.parametrize("template", [GEMMA_LIKE, LLAMA31_LIKE, QWEN_LIKE], ids=["gemma", "llama3.1", "qwen"])
def test_templates_render_as_transformers_renders_them(tmp_path, template):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, template)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = HFTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for messages, tools in ((TALK, None), (TALK[1:], TOOLS), (TALK[1:2], TOOLS)):
        want = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tools=tools) == want


def test_a_template_refusing_the_conversation_says_why(tmp_path):
    from jinja2.exceptions import TemplateError

    tok = HFTokenizer(_folder(tmp_path, GEMMA_LIKE))
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_named_templates_use_the_default_one(tmp_path):
    folder = _folder(tmp_path, "")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}))
    assert HFTokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "plain"
