"""The C structs the native backend passes are declared once in Python (``kernel.MODEL_FIELDS``
for ``model_t``) and checked against the compiled kernels at load: a field added, dropped,
moved or retyped on one side only stops the load, naming it, instead of a step reading the
wrong bytes."""

from __future__ import annotations

import ctypes

import pytest
from helpers.native import native_or_skip

from twophase.backends.native import kernel
from twophase.contract import BackendUnavailable


@pytest.fixture(scope="module")
def so():
    native_or_skip()
    return kernel.load()


def _struct(fields) -> type[ctypes.Structure]:
    return type("Altered", (ctypes.Structure,), {"_fields_": list(fields)})


def _check_model(so, fields) -> None:
    kernel.check_layout(so, "model_t", _struct(fields))


def test_the_declarations_match_the_compiled_kernels(so):
    assert kernel.Model._fields_ == list(kernel.MODEL_FIELDS)
    for c_name, struct in kernel.MIRRORS.items():
        kernel.check_layout(so, c_name, struct)
        assert so.tp_sizeof(c_name.encode()) == ctypes.sizeof(struct)
    _check_model(so, kernel.MODEL_FIELDS)


def test_two_fields_swapped_are_named(so):
    fields = list(kernel.MODEL_FIELDS)
    i, j = (next(n for n, f in enumerate(fields) if f[0] == name) for name in ("scale", "embed_scale"))
    fields[i], fields[j] = fields[j], fields[i]
    with pytest.raises(BackendUnavailable, match=r"model_t\.embed_scale is at offset (\d+) .* in step\.c but at "
                                                 r"(?!\1)\d+ .*model_t\.scale is at offset"):
        _check_model(so, fields)


def test_a_dropped_field_is_named(so):
    # act sits in padding before a pointer: no offset after it moves, so only its name tells
    with pytest.raises(BackendUnavailable, match=r"model_t\.act is in step\.c but not in kernel\.py's Altered"):
        _check_model(so, [f for f in kernel.MODEL_FIELDS if f[0] != "act"])
    with pytest.raises(BackendUnavailable, match=r"model_t\.layers is in step\.c but not"):
        _check_model(so, kernel.MODEL_FIELDS[1:])


def test_a_field_of_another_size_or_name_is_named(so):
    fields = [(n, ctypes.c_long if n == "norm_topk" else t) for n, t in kernel.MODEL_FIELDS]
    with pytest.raises(BackendUnavailable, match=r"model_t\.norm_topk is at offset \d+ \(4 bytes\) in step\.c but "
                                                 r"at \d+ \(8 bytes\)"):
        _check_model(so, fields)
    with pytest.raises(BackendUnavailable, match=r"model_t\.renamed is in kernel\.py's Altered but not in step\.c"):
        _check_model(so, [("renamed" if n == "top_k" else n, t) for n, t in kernel.MODEL_FIELDS])
    with pytest.raises(BackendUnavailable, match=r"model_t\.extra is in kernel\.py's Altered but not in step\.c"):
        _check_model(so, [*kernel.MODEL_FIELDS, ("extra", ctypes.c_void_p)])


def test_the_load_refuses_a_declaration_that_does_not_match(so, monkeypatch):
    swapped = [*kernel.MODEL_FIELDS[:1], *kernel.MODEL_FIELDS[2:3], kernel.MODEL_FIELDS[1], *kernel.MODEL_FIELDS[3:]]
    monkeypatch.setitem(kernel.MIRRORS, "model_t", _struct(swapped))
    with pytest.raises(BackendUnavailable, match=r"model_t\.dim is at offset 4 .* in step\.c but at 8"):
        kernel.load()
