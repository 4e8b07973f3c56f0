"""The engine's step loop in one background thread, fed through a thread-safe queue.

HTTP handlers run on the asyncio loop; the engine is not thread-safe and a step blocks for
milliseconds to seconds. So only this thread touches the engine: handlers put commands (add,
abort) on a queue and receive each request's deltas through a callback that hands them back to
their asyncio loop. Between steps the thread drains the queue, so every request that arrived
during a step joins the next one: that is continuous batching across HTTP clients.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twophase.core.outputs import RequestOutput
from twophase.core.params import SamplingParams
from twophase.errors import RequestRejected, StepFailed

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """More requests in flight than the configured queue limit."""


class Handle:
    """One request's stream on the asyncio side."""

    def __init__(self, owner: "EngineLoop", request_id: str):
        self.owner, self.request_id = owner, request_id
        self.items: asyncio.Queue = asyncio.Queue()
        self.done = False

    async def next(self) -> Any:
        """The next delta or ``Finished``; raises what the engine reported instead."""
        item = await self.items.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        if isinstance(item, Finished):
            self.done = True
        return item

    def abort(self) -> None:
        """Stop the request now and free its KV blocks (the client went away)."""
        if not self.done:
            self.done = True
            self.owner._commands.put(("abort", self.request_id))


@dataclass(frozen=True)
class Finished:
    """The last item of a request's stream."""

    output: RequestOutput              # a copy: the whole request as it ended

    @property
    def reason(self) -> str | None:
        return self.output.finish_reason


class EngineLoop:
    def __init__(self, llm, max_queue: int, on_step: Callable[[Any], None] | None = None,
                 on_finish: Callable[[Any], None] | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.on_step, self.on_finish = on_step, on_finish
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._in_flight = 0                      # admitted and not finished (any thread reads)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twophase-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    # -- the handlers' side (asyncio) -------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams) -> "Handle":
        """Queue a request; its deltas, then a ``Finished``, arrive through the handle. Raises
        ``Overloaded`` past the queue limit; a prompt that can never be served arrives as a
        ``RequestRejected`` from the handle's first ``next()``."""
        with self._lock:
            if self._in_flight >= self.max_queue:
                raise Overloaded(f"{self._in_flight} requests in flight (server.max_queue = "
                                 f"{self.max_queue}); retry later")
            self._in_flight += 1
        handle = Handle(self, f"req-{next(self._ids)}")
        loop = asyncio.get_running_loop()
        self._commands.put(("add", handle.request_id, prompt, params,
                            lambda item: loop.call_soon_threadsafe(handle.items.put_nowait, item)))
        return handle

    # -- the engine's side (this thread) ---------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._handle(self._commands.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            if self.engine.has_unfinished():
                self._step()

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt, params, sink = cmd
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except RequestRejected as exc:
                self._release_slot()
                sink(exc)
                return
            self._sinks[request_id] = sink
        elif cmd[0] == "abort":
            request_id = cmd[1]
            output = self.engine.abort(request_id)
            if output is not None:
                self._done(request_id, output)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except StepFailed as exc:        # the engine has ended the step's requests ("error")
            log.exception("engine step failed")
            for request_id in exc.request_ids:
                if request_id in self._sinks:
                    self._sinks[request_id](RuntimeError(f"the engine failed: {exc.__cause__}"))
                    self._done(request_id, None)
            return
        if self.on_step is not None and self.engine.steps.records:
            self.on_step(self.engine.steps.records[-1])
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is None:
                continue
            sink(d)
            if d.output is not None:
                sink(Finished(d.output))
                self._done(d.request_id, d.output)

    def _done(self, request_id: str, output: RequestOutput | None) -> None:
        self._sinks.pop(request_id, None)
        if output is not None and self.on_finish is not None:
            self.on_finish(output)
        self._release_slot()

    def _release_slot(self) -> None:
        with self._lock:
            self._in_flight -= 1
