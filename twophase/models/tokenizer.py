"""Tokenizers: an HF ``tokenizer.json`` through the fast ``tokenizers`` library (no
``transformers`` import at run time, so a cached model loads in seconds), and a byte-level
tokenizer for random-weight shapes, so they take text prompts too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    max_token_chars: int        # the most characters of text one token stands for
    chat_template: str | None   # the model's own (None: it has none)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str: ...
    def vocabulary(self) -> dict[str, int]: ...


class HFTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template = (template_path.read_text() if template_path.exists()
                              else _default_template(cfg.get("chat_template")))
        self._template: Any = None              # compiled on first use
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = (eos,) if eos is not None else ()
        self._special = {self._tok.token_to_id(t.content) for t in
                         self._tok.get_added_tokens_decoder().values() if t.special}
        # a byte-level token's string has one character per byte it stands for, and a text
        # character is at least a byte: n characters of text are at least n / this tokens
        self.max_token_chars = max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: the BOS the model's prompts start with, where it has one
        (False: the text's own tokens, as for a chat template that writes its BOS itself)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token:
            ids = [self._tok.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what a grammar engine reads)."""
        return self._tok.to_str()

    def vocabulary(self) -> dict[str, int]:
        """Every token's string and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The conversation rendered as HF's ``apply_chat_template(tokenize=False)`` renders
        it: same environment, globals and filters."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if self._template is None:
            self._template = template_environment().from_string(self.chat_template)
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


def template_environment():
    """A jinja2 sandbox set up as transformers sets up its chat templates' (``raise_exception``,
    ``strftime_now``, a ``tojson`` that keeps non-ASCII text, loop controls): the templates
    models ship are written against that one. Sandboxed: a downloaded template is untrusted."""
    import datetime

    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ByteTokenizer:
    """UTF-8 bytes as tokens (id = byte + 3; 0 pad, 1 bos, 2 eos): text in, text out, for
    random-weight models that ship no tokenizer."""

    OFFSET = 3
    max_token_chars = 1
    chat_template = None

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (2,)):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 259 tokens")
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def vocabulary(self) -> dict[str, int]:
        return {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": b + self.OFFSET for b in range(256)}

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant: " if add_generation_prompt else text


def _default_template(template: Any) -> str | None:
    """A ``tokenizer_config.json`` may hold named templates (a list of ``{name, template}``):
    the one named ``default`` is the chat template, as in transformers."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
