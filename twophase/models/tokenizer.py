"""Tokenizers: an HF ``tokenizer.json`` through the fast ``tokenizers`` library (no
``transformers`` import at run time, so a cached model loads in seconds), and a byte-level
tokenizer for random-weight shapes, so they take text prompts too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    max_token_chars: int        # the most characters of text one token stands for
    chat_template: str | None   # the model's own (None: it has none)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...
    def vocabulary(self) -> dict[str, int]: ...


class HFTokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template = (template_path.read_text() if template_path.exists()
                              else cfg.get("chat_template"))
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

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token:
            ids = [self._tok.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token's string and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # sandboxed, as HF renders them: a template from a downloaded model is untrusted code
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


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

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def vocabulary(self) -> dict[str, int]:
        return {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": b + self.OFFSET for b in range(256)}

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
