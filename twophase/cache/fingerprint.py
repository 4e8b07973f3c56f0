"""The key fingerprint: what produced a cached block's K/V, as 32 bytes that every block key is
rooted at.

A block's prefix-cache key is a sha256 chain: block ``i``'s key hashes block ``i - 1``'s key and
block ``i``'s tokens. The tokens alone do not say what the K/V means: the same tokens through
another model, another quantisation of the same model, another K/V dtype, block size or pool
layout, or another LoRA adapter give other bytes. Once blocks outlive the process (the disk tier)
or are shared between tenants, a key must name all of that, or a server would read K/V it cannot
use, silently. So the chain does not start from an empty parent but from
``root_hash(fingerprint, cache_salt)``:

* ``fingerprint = cache_fingerprint(**parts)`` covers what produced the K/V (the parts below);
* ``cache_salt`` is a per-request string (as vLLM's API has it): requests with different salts,
  or a salted and an unsalted one, never share a block, so one tenant cannot learn from timing
  that another sent a prompt.

The disk tier files blocks under the fingerprint too, so a restarted server on the same model
finds its blocks and one on another model finds none.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# the parts a fingerprint must name; a forgotten one would let two setups share keys. Each is a
# JSON value: a string, a number, a boolean, None, or lists and string-keyed tables of those.
REQUIRED_PARTS = (
    "model",            # the weights' identity: model_identity(path), or a hash the loader gives
    "weights_format",   # dtype, quantisation and its block format ("q4_0", "bfloat16", ...)
    "kv_format",        # the K/V cache's dtype/format ("float16", "int8" q8_0 rows, "fp8")
    "block_size",       # tokens a block
    "layout",           # the pool's layout: layers, kv heads, head dim, groups, sliding windows
    "tokenizer",        # the tokenizer's identity (equal token ids must mean equal text)
    "adapter",          # the LoRA adapter's name, or None
)
FINGERPRINT_VERSION = 1     # bump when the key derivation or the canonical form changes

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz")
_HEAD_BYTES = 1 << 20       # a .gguf's metadata sits at its head: hashed, the tensors are not


def cache_fingerprint(**parts: object) -> bytes:
    """32 bytes naming what produced a block's K/V: sha256 over a canonical JSON of ``parts``
    (keys sorted, no whitespace, floats as JSON writes them), which must include every name in
    ``REQUIRED_PARTS``; more parts may be given (each changes the fingerprint)."""
    missing = [p for p in REQUIRED_PARTS if p not in parts]
    if missing:
        raise ValueError(f"cache_fingerprint: missing part(s) {', '.join(missing)}; a fingerprint names "
                         f"every one of {', '.join(REQUIRED_PARTS)} (None where it does not apply)")
    for name, value in parts.items():
        _check_json(value, name)
    text = json.dumps({"fingerprint_version": FINGERPRINT_VERSION, "parts": parts},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).digest()


def root_hash(fingerprint: bytes, cache_salt: str | None = None) -> bytes:
    """The parent of a request's first block: its chain hash is ``sha256(root_hash(...) + tokens)``.

    ``None`` (no salt) and ``""`` (an empty salt) give different roots: a salt, once given, never
    matches the unsalted blocks."""
    if len(fingerprint) != 32:
        raise ValueError(f"root_hash: a fingerprint is 32 bytes (cache_fingerprint), got {len(fingerprint)}")
    h = hashlib.sha256(b"twophase-kv-root\x00")
    h.update(fingerprint)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def model_identity(path: str | os.PathLike[str]) -> dict[str, object]:
    """The ``model`` part for weights on disk, cheap enough to compute at every start: each weight
    file's name and size, and a content hash of ``config.json`` (a folder) or of a single file's
    first MiB (a .gguf keeps its metadata there). Hashing all the weights would take longer than
    loading them; names and sizes change with any re-quantisation or re-conversion."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
        return {"file": p.name, "bytes": p.stat().st_size, "head_sha256": head}
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    config = p / "config.json"
    return {
        "files": [[f.relative_to(p).as_posix(), f.stat().st_size] for f in files],
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
    }


def _check_json(value: object, where: str) -> None:
    """Only values whose JSON text is one and the same everywhere: a torch dtype, a Path or a set
    would be written by ``str()`` or refused depending on the caller, so they are refused here."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cache_fingerprint: part {where} is {value}, not a finite number")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"cache_fingerprint: part {where} has a key {k!r} that is not a string")
            _check_json(v, f"{where}.{k}")
        return
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    raise TypeError(f"cache_fingerprint: part {where} is a {type(value).__name__}; give a string, number, "
                    f"boolean, None, or lists and tables of those (e.g. str(dtype))")
