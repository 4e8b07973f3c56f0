"""The Ray shells around ``EngineHost``: a Serve deployment for replicas (Serve routes to them,
checks their health and replaces one that dies) and a plain actor for prefill and decode
workers (addressed by name: a decode worker pulls K/V from the prefill worker that holds it)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from twophase.cluster.board import BOARD
from twophase.cluster.host import EngineHost, Job
from twophase.cluster.transport import RayTransport
from twophase.config import Config


class _Shell:
    host: EngineHost

    async def generate(self, job: Job) -> AsyncIterator[Any]:
        async for item in self.host.generate(job):
            yield item

    def describe(self) -> dict[str, Any]:
        return self.host.describe()

    def abort(self, request_id: str) -> None:
        self.host.abort(request_id)

    def kv_state(self) -> dict[str, int]:
        return self.host.kv_state()


@serve.deployment(name="twophase-engine", health_check_period_s=1.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=5.0)
class EngineReplica(_Shell):
    def __init__(self, config: Config, threads: int | None, namespace: str):
        replica = serve.get_replica_context().replica_id
        self.host = EngineHost(config, f"replica-{replica.unique_id}", threads,
                               board=ray.get_actor(BOARD, namespace=namespace))
        self.actor_name = replica.to_full_id_str()

    def describe(self) -> dict[str, Any]:
        return {**self.host.describe(), "actor": self.actor_name}

    def check_health(self) -> None:
        """Serve replaces a replica whose engine has stopped."""
        if not self.host.loop.alive:
            raise RuntimeError(f"the engine has stopped: {self.host.loop.fatal}")


def lower_priority(nice: int) -> None:
    """This thread at niceness ``nice`` at least, and so the threads it starts: the engine's
    loop and its backends' pools (on Linux each thread has its own niceness, and a thread starts
    with its creator's). In an async actor this is Ray's event-loop thread, which runs the
    actor's methods too; Ray's own threads (the object store's puts among them) keep theirs."""
    if not hasattr(os, "setpriority"):
        return
    me = threading.get_native_id() if sys.platform.startswith("linux") else 0
    os.setpriority(os.PRIO_PROCESS, me, max(nice, os.getpriority(os.PRIO_PROCESS, me)))


class EngineWorker(_Shell):
    """A prefill worker (keeps prompts' blocks for decode workers) or a decode worker (pulls
    them: it has a transport)."""

    def __init__(self, config: Config, name: str, threads: int | None, namespace: str, pulls: bool,
                 nice: int = 0):
        if nice:         # before the engine's threads start: they inherit it
            lower_priority(nice)
        self.host = EngineHost(config, name, threads, RayTransport(namespace) if pulls else None,
                               board=ray.get_actor(BOARD, namespace=namespace))

    async def read_kv(self, lease_id: str):
        return await self.host.read_kv(lease_id)

    def delay_reads(self, seconds: float) -> None:
        self.host.delay_reads(seconds)

    def kv_transfers(self) -> list[tuple[int, int, float]]:
        return self.host.kv_transfers()

    def release_kv(self, lease_id: str) -> None:
        self.host.release_kv(lease_id)
