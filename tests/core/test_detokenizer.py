"""Incremental detokenisation never releases a broken multi-byte character."""

from twophase.core.detokenizer import IncrementalDetokenizer
from twophase.models.tokenizer import ByteTokenizer


def test_multibyte_characters_split_across_tokens_come_out_whole():
    tok = ByteTokenizer(512)
    text = "naïve café → 🙂 日本語!"
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(t) for t in tok.encode(text)]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the 4-byte emoji is held back until its last byte arrives
    emoji_bytes = len("🙂".encode())
    assert sum(1 for p in pieces if p == "") >= emoji_bytes - 1


def test_flush_releases_an_incomplete_tail():
    tok = ByteTokenizer(512)
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("a🙂")[:-1]           # the emoji is cut short
    out = "".join(d.push(t) for t in ids)
    assert out == "a"
    assert d.flush() == "\ufffd"
