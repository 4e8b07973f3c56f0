"""Which replica takes a request: the one whose prefix cache most likely holds its prompt's
beginning, unless its queue is longer than the shortest by more than ``imbalance``; otherwise
power of two choices (as Ray Serve LLM's prefix-aware router and SGLang's router do).

"Most likely holds" is what this router itself sent there: for each request it remembers, by
the hashes of the prompt's first 1..``depth`` full blocks, the replica it went to, and a new
request goes where its deepest known prefix went. Runs in the frontend's process, inside Ray
Serve's request router (``ray.serve.request_router.RequestRouter``)."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

DEPTH = 8          # blocks of a prompt's beginning that routing remembers


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
    """Prefix hash -> the replica it was last sent to, least recently used dropped first."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.owner: OrderedDict[bytes, Any] = OrderedDict()

    def best(self, keys: list[bytes], alive: set[Any]) -> Any | None:
        for k in reversed(keys):                       # the deepest match first
            owner = self.owner.get(k)
            if owner is not None and owner in alive:
                return owner
        return None

    def record(self, keys: list[bytes], replica: Any) -> None:
        for k in keys:
            self.owner[k] = replica
            self.owner.move_to_end(k)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def forget(self, replica: Any) -> None:
        for k in [k for k, v in self.owner.items() if v == replica]:
            del self.owner[k]


def job_tokens(pending: PendingRequest | None) -> list[int] | None:
    job = pending.args[0] if pending is not None and pending.args else None
    return getattr(job, "prompt_token_ids", None)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, depth: int = DEPTH, imbalance: int = 4,
                         **_: Any) -> None:
        self.block_size, self.depth, self.imbalance = block_size, depth, imbalance
        self.prefixes = PrefixMap()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        tokens = job_tokens(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        if tokens is not None:
            owner = self.prefixes.best(prefix_keys(tokens, self.block_size, self.depth), set(by_id))
            if owner is not None:
                lens = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
                if lens[owner] - min(lens.values()) <= self.imbalance:
                    return [[by_id[owner]]]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]     # the shorter queue of the two wins

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        tokens = job_tokens(pending_request)
        if tokens is not None:
            self.prefixes.record(prefix_keys(tokens, self.block_size, self.depth), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id)
