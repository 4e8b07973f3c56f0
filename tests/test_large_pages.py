"""What a step streams (the native backend's weights, its logits, calibrate's buffers) lies in
memory asked to be backed by 2 MB pages."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from twophase.backends.native.packed import ALIGN, arena
from twophase.large_pages import LARGE_PAGE, region, zeroed

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
large_pages = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                                 reason="this kernel gives no transparent large pages")


def mapping_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping holding ``address``."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in entry.split(None, 1)[0].split("-"))
        if lo <= address < hi:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_region_is_zeroed_writable_and_starts_on_a_large_page():
    r = region(3 * LARGE_PAGE + 5)
    assert r.dtype == np.uint8 and r.shape == (3 * LARGE_PAGE + 5,)
    assert r.ctypes.data % LARGE_PAGE == 0 and not r.any()
    r[-1] = 7
    assert r[-1] == 7 and region(0).shape == (0,)


def test_zeroed_memory_is_zero_writable_and_on_a_64_byte_boundary():
    for n in (0, 1, 1000, 3 * 4096 + 7):
        z = zeroed(n)
        assert z.dtype == np.uint8 and z.shape == (n,) and z.ctypes.data % 64 == 0 and not z.any()
        z[:] = 1


def test_without_anonymous_mappings_a_region_is_plain_zeroed_memory(monkeypatch):
    import mmap

    monkeypatch.delattr(mmap, "MAP_ANONYMOUS")
    r = region(1000)
    assert r.shape == (1000,) and r.ctypes.data % 64 == 0 and not r.any()
    r[:] = 1                                              # writable


def test_the_arena_holds_equal_copies_each_on_a_page_of_its_own():
    rng = np.random.default_rng(0)
    arrays = {"a": rng.integers(0, 255, (7, 133), dtype=np.uint8), "b": rng.standard_normal(5).astype(np.float32),
              "empty": np.zeros((0, 3), np.int32), "c": rng.integers(0, 9, (3, 2), dtype=np.int64)}
    out = arena(arrays)
    assert out.keys() == arrays.keys()
    for name, arr in arrays.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name], arr)
        assert out[name].ctypes.data % ALIGN == 0
        assert not np.shares_memory(out[name], arr)
    spans = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for v in out.values() if v.nbytes)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))   # none overlaps the next


@large_pages
def test_the_weights_are_asked_for_large_pages():
    """``hg`` in the mapping's flags: set by madvise(MADV_HUGEPAGE) alone (THP ``always`` makes
    any mapping eligible, so eligibility would not show the request)."""
    w = arena({"w": np.ones(3 * LARGE_PAGE, np.uint8)})["w"]
    flags = re.search(r"^VmFlags:(.*)$", mapping_of(w.ctypes.data), re.M)
    assert flags and "hg" in flags.group(1).split(), mapping_of(w.ctypes.data)
