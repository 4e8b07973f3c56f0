"""Zeroed CPU memory the OS is asked to back with 2 MB pages, for what a step streams.

A decode step reads every weight once. On 4 KB pages the hardware's prefetchers stop at each
page's end and each page costs a translation (a two-level walk under a VM), and a plain read
runs markedly faster on 2 MB pages (docs/measurements.md).
Linux backs an anonymous region with 2 MB pages where madvise asks (transparent_hugepage =
madvise, the common default) at its first touch, so the region is asked before it is touched.
Where the OS gives none (another OS, THP off, no free 2 MB frames) the same memory comes on
plain pages.

Not for the K/V pool: its blocks are first written by the steps that fill them, and a first
touch of a 2 MB page zeroes all of it (and may wait for the OS to compact memory): with the pool
on large pages and not prefaulted, the default model's 512-token prefill ran 10% slower."""

from __future__ import annotations

import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)

LARGE_PAGE = 2 << 20


def region(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (uint8) from their own anonymous mapping, starting on a 2 MB
    boundary, asked for large pages; the OS zeroes each page at its first touch, so what is
    never used costs no memory. Without anonymous mappings (Windows): ``zeroed``."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):     # not a Unix: on the OS's own pages
        return zeroed(nbytes)
    m = mmap.mmap(-1, nbytes + LARGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, np.uint8)
    start = -raw.ctypes.data % LARGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes:
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError as e:                # plain pages serve
            log.debug("no large pages: %s", e)
    return raw[start:start + nbytes]


def zeroed(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (uint8), calloc'd (the OS zeroes each page at its first touch) on
    the OS's own pages, starting on a 64-byte boundary (runtimes that import them, IREE through
    DLPack, require it)."""
    raw = np.zeros(nbytes + 64, np.uint8)
    return raw[-raw.ctypes.data % 64:][:nbytes]
