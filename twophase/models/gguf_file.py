"""A GGUF file's header: its metadata and tensor table, read once, without walking big arrays.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, so the
vocabulary alone (49,152 strings for SmolLM2, 262,144 for Gemma 3) cost 10 of a load's 12 s on a
Zen 3 core. Planning and loading need scalars, shapes, tensor types and data offsets: this reader
keeps scalars and short arrays, records a long array by its element type and length, and maps a
tensor's bytes only when asked (the layout is ggml's ``gguf.md``: little-endian, version 2 or 3).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twophase.errors import ModelError

MAGIC = b"GGUF"
SHORT_ARRAY = 1024            # arrays up to this many elements are kept (per-layer counts and the like)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types numpy reads as they are; every other type is blocks of bytes
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to keep: its element type (GGUF's code) and length."""
    element_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int                 # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]          # as GGUF stores them: the row length first
    offset: int                    # of the data, from the start of the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order (rows, then the row length): ``reversed(dims)``."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """``GGUFFile(path)``: ``metadata`` (key -> value, or a ``LongArray``), ``tensors`` (name ->
    ``TensorInfo``) and ``data(name)``, a read-only view of a tensor's stored bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:      # a missing or empty file
            raise ModelError(f"{self.path}: not a readable GGUF file ({exc})") from None
        try:
            self.metadata, self.tensors, self.data_offset = self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as exc:
            raise ModelError(f"{self.path}: not a readable GGUF file (truncated or corrupt header: "
                             f"{exc})") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes as ``gguf.GGUFReader`` gives them: plain types typed and shaped,
        block types as uint8 rows of the stored row's bytes."""
        t = self.tensors[name]
        plain = _PLAIN.get(t.ggml_type)
        if plain is not None:
            return np.frombuffer(self._map, plain, int(np.prod(t.dims)), t.offset).reshape(t.shape)
        return self.rows(name).reshape(*t.shape[:-1], -1)

    def rows(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, any type, as uint8 rows ``[rows, bytes a row]``."""
        t = self.tensors[name]
        rows = int(np.prod(t.dims[1:])) if len(t.dims) > 1 else 1
        return np.frombuffer(self._map, np.uint8, t.n_bytes, t.offset).reshape(rows, t.n_bytes // rows)

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
        import gguf

        buf = self._map
        if buf[:4] != MAGIC:
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; versions 2 and 3 load")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            metadata[key], pos = _value(buf, pos, vtype)
        tensors: dict[str, TensorInfo] = {}
        raw = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            raw.append((name, ggml_type, dims, offset))
        align = int(metadata.get("general.alignment", 32))
        start = pos + (-pos % align)
        for name, ggml_type, dims, offset in raw:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            n_bytes = int(np.prod(dims)) * size // block
            if start + offset + n_bytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            tensors[name] = TensorInfo(name, ggml_type, tuple(int(d) for d in dims), start + offset, n_bytes)
        return metadata, tensors, start


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype != _ARRAY:
        raise ValueError(f"unknown metadata type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:
        size = struct.calcsize(_SCALARS[etype])
        if count > SHORT_ARRAY:
            return LongArray(etype, count), pos + size * count
        return list(struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", buf, pos)), pos + size * count
    if etype == _STRING:
        if count > SHORT_ARRAY:
            for _ in range(count):            # only the lengths are read
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            return LongArray(etype, count), pos
        items = []
        for _ in range(count):
            s, pos = _string(buf, pos)
            items.append(s)
        return items, pos
    raise ValueError(f"metadata arrays of type {etype} are not read")
