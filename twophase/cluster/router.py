"""Which replica takes a request: the one whose prefix cache most likely holds its prompt's
beginning, unless its queue is longer than the shortest by more than ``imbalance``; otherwise
power of two choices (as Ray Serve LLM's prefix-aware router and SGLang's router do).

"Most likely holds" is what this router itself sent there (``affinity.py``, the rule the
frontend and the simulator share; here the fallback draws two at random, as Ray Serve's own
router does). Runs in the frontend's process, inside Ray Serve's request router
(``ray.serve.request_router.RequestRouter``)."""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from twophase.cluster.affinity import DEPTH, PrefixMap, prefix_keys

__all__ = ["DEPTH", "PrefixAffinityRouter", "PrefixMap", "prefix_keys"]


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
