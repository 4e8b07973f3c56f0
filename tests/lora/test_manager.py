"""The resident set: slots given and taken back, least recently used first, never from under a
running request; errors name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from twophase.lora.manager import LoraManager
from twophase.lora.peft_adapter import AdapterError, LoraAdapter


def _manager(max_loras=2):
    placed: dict[int, str | None] = {}

    def loader(name: str, path: Path) -> LoraAdapter:
        if "bad" in name:
            raise AdapterError(f"{path}: broken")
        a = LoraAdapter(name, path, 4)
        return a

    m = LoraManager(loader, lambda slot, a: placed.__setitem__(slot, a and a.name), max_loras)
    return m, placed


def test_slots_are_reused_least_recently_used_first_and_never_from_a_running_request():
    m, placed = _manager()
    for n in "abc":
        m.register(n, f"/x/{n}")
    sa = m.acquire("a")
    sb = m.acquire("b")
    assert {sa, sb} == {0, 1} and placed == {sa: "a", sb: "b"}
    with pytest.raises(AdapterError, match="all 2 adapter slots") as exc:
        m.acquire("c")                              # both serve a request
    assert exc.value.busy and not m.can_acquire("c")
    m.release("a")
    m.acquire("b")                                  # b is the most recent: a goes first
    assert m.acquire("c") == sa and placed[sa] == "c" and m.resident == ["b", "c"]
    assert m.stats["c"].loads == 1 and m.stats["b"].served == 2
    m.release("c")
    assert m.acquire("c") == sa and m.stats["c"].loads == 1     # still resident: not read again


def test_names_and_unloading():
    m, placed = _manager()
    m.register("a", "/x/a")
    with pytest.raises(AdapterError, match="already loaded"):
        m.register("a", "/x/other")
    with pytest.raises(AdapterError, match="no adapter named 'z'") as exc:
        m.acquire("z")
    assert exc.value.not_found
    with pytest.raises(AdapterError, match="broken"):
        m.register("bad", "/x/bad", load_now=True)
    assert "bad" not in m.known                     # a failed load leaves nothing behind
    slot = m.acquire("a")
    with pytest.raises(AdapterError, match="serving 1 request"):
        m.unregister("a")
    m.release("a")
    m.unregister("a")
    assert placed[slot] is None and m.resident == [] and "a" not in m.known
    with pytest.raises(AdapterError, match="no adapter named 'a'"):
        m.unregister("a")
