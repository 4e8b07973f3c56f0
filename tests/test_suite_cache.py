"""The suite keeps its artefacts out of the user's cache (it left 4.8 GB there once)."""

from __future__ import annotations

import os

from twophase.paths import cache_dir


def test_the_suite_writes_its_own_cache_not_the_users():
    root = str(cache_dir())
    assert root == os.environ.get("TWOPHASE_TEST_CACHE", root) and (
        "TWOPHASE_TEST_CACHE" in os.environ or root.endswith("-tests")), root
