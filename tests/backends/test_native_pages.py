"""The native backend's weights go into one region asked to be backed by 2 MB pages."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from twophase.backends.native.packed import ALIGN, LARGE_PAGE, arena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_of(address: int) -> str:
    """The /proc/self/smaps entry of the mapping holding ``address``."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
    for entry in entries:
        lo, hi = (int(x, 16) for x in entry.split(None, 1)[0].split("-"))
        if lo <= address < hi:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


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
    assert out["a"].ctypes.data % LARGE_PAGE == 0          # the region starts on a large page
    ends = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for v in out.values() if v.nbytes)
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:]))   # none overlaps the next


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel gives no transparent large pages")
def test_the_arena_is_asked_for_large_pages():
    out = arena({"w": np.ones(3 * LARGE_PAGE, np.uint8)})
    entry = vma_of(out["w"].ctypes.data)
    assert re.search(r"^THPeligible:\s+1", entry, re.M), entry
