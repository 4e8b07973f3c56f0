"""The host-memory tier: an LRU bounded by payload bytes that hands back what it gives up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twophase.cache.host_tier import HostTier


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_round_trip_and_bookkeeping():
    t = HostTier(100)
    assert t.put(k(1), b"a" * 10) == [] and t.put(k(2), b"b" * 20) == []
    assert k(1) in t and k(3) not in t and len(t) == 2 and t.bytes_used == 30
    assert t.get(k(1)) == b"a" * 10 and t.get(k(3)) is None
    c = t.counters
    assert (c.hits, c.misses, c.bytes_in, c.bytes_out) == (1, 1, 30, 10)
    assert t.pop(k(2)) == b"b" * 20 and t.bytes_used == 10 and t.pop(k(2)) is None


def test_the_least_recently_used_go_first_and_come_back_oldest_first():
    t = HostTier(30)
    for i in (1, 2, 3):
        t.put(k(i), bytes([i]) * 10)
    assert t.get(k(1)) is not None              # 1 is now the most recent: 2, 3, 1
    assert t.put(k(4), b"\4" * 20) == [(k(2), b"\2" * 10), (k(3), b"\3" * 10)]
    assert [key for key, _ in t.items()] == [k(1), k(4)]
    assert t.bytes_used == 30 and t.counters.evicted == 2


def test_putting_a_key_again_replaces_it_and_makes_it_recent():
    t = HostTier(30)
    t.put(k(1), b"x" * 10)
    t.put(k(2), b"y" * 10)
    assert t.put(k(1), b"x" * 15) == []
    assert len(t) == 2 and t.bytes_used == 25
    assert t.put(k(3), b"z" * 10) == [(k(2), b"y" * 10)]


def test_a_payload_over_the_limit_is_handed_back_at_once_and_zero_keeps_nothing():
    t = HostTier(10)
    t.put(k(1), b"a" * 5)
    assert t.put(k(2), b"b" * 11) == [(k(2), b"b" * 11)]
    assert k(2) not in t and t.bytes_used == 5 and t.get(k(1)) == b"a" * 5
    z = HostTier(0)
    assert z.put(k(1), b"a") == [(k(1), b"a")] and len(z) == 0 and z.bytes_used == 0
    assert z.put(k(2), b"") == []               # an empty payload costs nothing
    with pytest.raises(ValueError, match="max_bytes"):
        HostTier(-1)


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 40), st.booleans()), max_size=60))
def test_bytes_stay_under_the_limit_and_nothing_is_lost(ops):
    """Every payload put is either still held or was handed back exactly once (the newest copy)."""
    t = HostTier(64)
    latest: dict[bytes, bytes] = {}
    handed_back: dict[bytes, bytes] = {}
    for i, size, read in ops:
        if read:
            got = t.get(k(i))
            assert got is None or got == latest[k(i)]
            continue
        payload = bytes([i]) * size
        latest[k(i)] = payload
        handed_back.pop(k(i), None)
        for key, p in t.put(k(i), payload):
            handed_back[key] = p
        assert t.bytes_used == sum(len(p) for _, p in t.items()) <= 64
    held = dict(t.items())
    assert held.keys().isdisjoint(handed_back)
    assert {**held, **handed_back} == latest
