"""Prefix affinity, without Ray: which engine most likely holds a prompt's beginning in its
prefix cache, and the rule that sends a request there unless that engine is too busy.

"Most likely holds" is what the router itself sent there: for each request it remembers, by the
hashes of the prompt's first 1..``depth`` full blocks, the engine it went to, and a new request
goes where its deepest known prefix went. The cluster's frontend (``launch.Cluster.pick``), its
Ray Serve router (``router.py``) and the simulator's fleet (``twophase/simulate/fleet.py``) all
route with these, so a change to the rule shows in each."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

DEPTH = 8          # blocks of a prompt's beginning that routing remembers

W = TypeVar("W")


def prefix_keys(token_ids: list[int], block_size: int, depth: int = DEPTH) -> list[bytes]:
    """Chain hashes of the first 1..``depth`` full blocks (the last token never counts: an
    engine always computes it), shallowest first."""
    keys: list[bytes] = []
    h = b""
    for i in range(min(depth, (len(token_ids) - 1) // block_size)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little", signed=True) for t in block),
                            digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixMap:
    """Prefix hash -> the engine it was last sent to, least recently used dropped first."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.owner: OrderedDict[bytes, Any] = OrderedDict()

    def best(self, keys: list[bytes], alive: set[Any]) -> Any | None:
        for k in reversed(keys):                       # the deepest match first
            owner = self.owner.get(k)
            if owner is not None and owner in alive:
                return owner
        return None

    def record(self, keys: list[bytes], engine: Any) -> None:
        for k in keys:
            self.owner[k] = engine
            self.owner.move_to_end(k)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def forget(self, engine: Any) -> None:
        for k in [k for k, v in self.owner.items() if v == engine]:
            del self.owner[k]


def pick(workers: Sequence[W], load: Callable[[W], int], prefixes: PrefixMap, imbalance: int,
         tokens: list[int] | None = None, block_size: int = 16) -> W:
    """The least loaded of ``workers`` (the first of equals); given a prompt's ``tokens``, the one
    sent its deepest known prefix unless its load exceeds the least loaded's by more than
    ``imbalance``. The choice is recorded for the prompt's prefixes."""
    least = min(workers, key=load)
    if tokens is None:
        return least
    keys = prefix_keys(tokens, block_size)
    owner = prefixes.best(keys, set(workers))
    chosen = owner if owner is not None and load(owner) - load(least) <= imbalance else least
    prefixes.record(keys, chosen)
    return chosen
