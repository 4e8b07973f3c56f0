"""One engine in a Ray worker: an ``LLM`` and its ``EngineLoop``, as a replica of the Serve
deployment or as a prefill or decode worker. Everything it sends back is a value: ``Delta``s,
and a ``Failure`` in place of an exception (an exception would reach the caller wrapped in
Ray's error types)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from twophase.cluster.board import POST_EVERY_S
from twophase.config import Config
from twophase.core.kv_transfer import KVTransferParams
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected
from twophase.server.loop import EngineError, EngineLoop, EngineStopped, Finished, Handle, Overloaded
from twophase.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """Why a request ended without its output: ``kind`` is "rejected" (its own fault),
    "overloaded", "stopped" or "engine"."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: Exception) -> Failure:
        kind = next((k for k, t in FAILURES.items() if isinstance(exc, t)), "engine")
        return cls(kind, str(exc))

    def exception(self) -> Exception:
        """The exception the frontend raises for it (the HTTP layer maps each to a status)."""
        return FAILURES.get(self.kind, EngineError)(self.message)


# kinds of failure and their exceptions, the most specific first (EngineStopped is an EngineError)
FAILURES: dict[str, type[Exception]] = {"rejected": RequestRejected, "overloaded": Overloaded,
                                        "stopped": EngineStopped, "engine": EngineError}


@dataclass(frozen=True)
class Job:
    """One request for a worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: KVTransferParams | None = None
    first_token_ids: tuple[int, ...] = ()
    priority: int = 0                        # on the worker that serves it (each ranks its own)


class EngineHost:
    def __init__(self, config: Config, name: str, threads: int | None = None,
                 transport: Any = None, board: Any = None):
        if threads:
            torch.set_num_threads(threads)
        from twophase.llm import LLM

        self.name = name
        self.llm = LLM(config)
        engine = self.llm.engine
        engine.connector.engine_id = name
        engine.connector.transport = transport
        m = self.metrics = ServerMetrics()
        m.kv_total.set(engine.stats().total_blocks)
        m.loaded(self.llm.memory)
        self.loop = EngineLoop(self.llm, config.server.max_queue, on_step=m.step, on_finish=m.finished,
                               on_change=lambda: m.refresh(engine.stats()))
        self.read_delay_s = 0.0
        self._leases: dict[str, str] = {}                   # caller's id -> lease, until released
        self._handles: dict[str, tuple[Handle, asyncio.AbstractEventLoop]] = {}   # by caller's id
        if board is not None:
            threading.Thread(target=self._post_metrics, args=(board,), daemon=True,
                             name="twophase-metrics").start()

    def describe(self) -> dict[str, Any]:
        """What the frontend checks and routes by."""
        c = self.llm.engine.connector
        return {"name": self.name, "layout": c.layout, "max_model_len": self.llm.max_model_len,
                "block_size": self.llm.config.cache.block_size, "model_id": self.llm.model.model_id}

    async def generate(self, job: Job) -> AsyncIterator[Any]:
        """The request's ``Delta``s (the last carries its output), or one ``Failure``."""
        try:
            handle = self.loop.submit(job.prompt_token_ids, job.params, None, job.kv_transfer,
                                      job.first_token_ids, priority=job.priority)
        except Exception as exc:
            yield Failure.of(exc)
            return
        self._handles[job.request_id] = (handle, asyncio.get_running_loop())
        try:
            while True:
                try:
                    item = await handle.next()
                except Exception as exc:
                    yield Failure.of(exc)
                    return
                if isinstance(item, Finished):
                    return
                kv = item.output.kv_transfer_params if item.output is not None else None
                if kv is not None:                 # released by abort() if the caller goes away
                    self._leases[job.request_id] = kv["remote_request_id"]
                yield item
        finally:                    # also when the caller cancels (its client went away)
            handle.abort()
            self._handles.pop(job.request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request by the caller's id (the caller's own cancel may not reach us)."""
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self.release_kv(lease)
        entry = self._handles.get(request_id)
        if entry is not None:
            handle, loop = entry
            handle.abort()
            loop.call_soon_threadsafe(handle.items.put_nowait, EngineStopped("aborted"))

    async def read_kv(self, lease_id: str):
        """A leased prompt's blocks and state as bytes (numpy, which has no bfloat16: the object
        store holds it without a copy)."""
        if self.read_delay_s:
            await asyncio.sleep(self.read_delay_s)
        return self.llm.engine.connector.read(lease_id).cpu().numpy()

    def delay_reads(self, seconds: float) -> None:
        """Fault injection: hold every ``read_kv`` this long (a slow or stalled peer)."""
        self.read_delay_s = seconds

    def release_kv(self, lease_id: str) -> None:
        connector = self.llm.engine.connector
        self.loop.call(lambda: connector.release(lease_id))
        self._leases = {k: v for k, v in self._leases.items() if v != lease_id}

    def kv_state(self) -> dict[str, int]:
        """Blocks held by requests and by leases (tests check both return to zero)."""
        e = self.llm.engine
        return {"used_blocks": e.stats().used_blocks, "leased_blocks": e.connector.num_leased_blocks,
                "in_flight": self.loop.in_flight}

    def kv_transfers(self) -> list[tuple[int, int, float]]:
        """(tokens, bytes, seconds) of this worker's recent pulls."""
        return list(self.llm.engine.connector.transfers)

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.metrics.registry).decode()

    def _post_metrics(self, board: Any) -> None:
        """Post this worker's figures to the board while it runs (``board.py``)."""
        while self.loop.alive:
            try:
                board.post.remote(self.name, self.metrics_text())
            except Exception:
                log.exception("posting metrics failed")
            time.sleep(POST_EVERY_S)

    def close(self) -> None:
        if self.loop.close():
            self.llm.close()
