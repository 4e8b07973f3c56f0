"""The engine's step loop in one background thread, fed through a thread-safe queue.

HTTP handlers run on the asyncio loop; the engine is not thread-safe and a step blocks for
milliseconds to seconds. So only this thread touches the engine: handlers put commands (add,
abort) on a queue and receive each request's deltas through a callback that hands them back to
their asyncio loop. Between steps the thread drains the queue, so every request that arrived
during a step joins the next one: that is continuous batching across HTTP clients.

Nothing a request does ends the loop: an exception while adding or stepping ends the requests it
concerns with an error and the loop goes on. Only when steps keep failing for requests that had
already computed (``max_failed_steps`` such failures with no decode succeeding between them: a
new prompt that breaks its first step may be at fault itself) does the loop give up: every open
and queued request gets an error, ``alive`` turns false (``/health`` then answers 503) and
``on_fatal`` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from twophase.core.engine_values import PreparedPrompt
from twophase.core.kv_transfer import KVTransferParams
from twophase.core.outputs import RequestOutput
from twophase.core.pooling import PoolingParams
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected, StepFailed, TwophaseError
from twophase.server.commands import Abort, Call, Command, FailAll, Submit, Wake

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """More requests in flight than the configured queue limit."""


class EngineError(TwophaseError):
    """The engine failed while serving a request (not the request's fault): a 500."""


class EngineStopped(EngineError):
    """The engine has stopped for good (or is shutting down): a 503, try another replica."""


class Handle:
    """One request's stream on the asyncio side."""

    def __init__(self, request_id: str, on_abort: Callable[[], None]):
        self.request_id, self.on_abort = request_id, on_abort
        self.items: asyncio.Queue = asyncio.Queue()
        self.done = False
        self._first: Any = None

    async def next(self) -> Any:
        """The next delta or ``Finished``; raises what the engine reported instead."""
        if self._first is not None:
            item, self._first = self._first, None
            return item
        item = await self.items.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        if isinstance(item, Finished):
            self.done = True
        return item

    async def first(self) -> Any:
        """Wait for the first item and keep it for ``next()``: a refusal raises here, before
        a reply has started."""
        self._first = await self.next()
        return self._first

    def abort(self) -> None:
        """Stop the request now and free its KV blocks (the client went away)."""
        if not self.done:
            self.done = True
            self.on_abort()


@dataclass(frozen=True)
class Finished:
    """The last item of a request's stream."""

    output: RequestOutput              # a copy: the whole request as it ended

    @property
    def reason(self) -> str | None:
        return self.output.finish_reason


class Loop(Protocol):
    """What the HTTP layer needs of the engines behind it (``EngineLoop``: one, here;
    ``twophase.cluster.frontend.ClusterLoop``: several, on Ray)."""

    fatal: BaseException | None
    max_model_len: int                  # the longest request, prompt and output together

    @property
    def in_flight(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    async def prepare(self, prompt: str | list[int], params: SamplingParams) -> PreparedPrompt | list[int]:
        """What ``submit`` takes: the prompt's token ids, checked as far as this side can."""
        ...

    async def constrain(self, params: SamplingParams) -> Any:
        """A structured-output request's grammar state, compiled off the engine's thread (or
        None where the engine compiles it itself); ``RequestRejected`` naming a bad grammar."""
        ...

    def submit(self, prompt: PreparedPrompt | list[int], params: SamplingParams,
               constraint: Any = None, *, priority: int = 0) -> Handle: ...

    def submit_choices(self, prompt: PreparedPrompt | list[int], params: SamplingParams,
                       constraint: Any = None, *, priority: int = 0) -> list[Handle]:
        """``params.n`` handles, one a choice, in order."""
        ...

    def fail_all(self, message: str) -> None: ...

    def close(self, timeout: float = 10.0) -> bool: ...


GRAMMAR_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="twophase-grammar")


class EngineLoop:
    def __init__(self, llm, max_queue: int, on_step: Callable[[Any], None] | None = None,
                 on_finish: Callable[[Any], None] | None = None,
                 on_change: Callable[[], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 max_failed_steps: int = 3):
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.max_model_len: int = self.engine.max_model_len
        self.on_step, self.on_finish, self.on_change = on_step, on_finish, on_change
        self.on_fatal = on_fatal
        self.max_failed_steps = max_failed_steps
        self.fatal: BaseException | None = None
        self._closed = False                     # no more submissions (under _lock)
        self._failed_steps = 0
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
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

    @property
    def alive(self) -> bool:
        return self.fatal is None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the loop after its current step; False if it is still stepping after
        ``timeout`` seconds (its backends must not be closed under it then)."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._commands.put(Wake())
        self._thread.join(timeout=timeout)
        self._refuse_queued("the server is shutting down")
        return not self._thread.is_alive()

    # -- the handlers' side (asyncio) -------------------------------------------------------
    async def prepare(self, prompt: str | list[int], params: SamplingParams) -> PreparedPrompt:
        """The prompt tokenised and checked against every limit the request must meet
        (``Engine.prepare``), in a worker thread: a huge prompt is tokenised (or refused) off
        the engine's thread, and one that could never run is refused before it queues
        (``RequestRejected``). The engine does not check it again."""
        return await asyncio.to_thread(self.engine.prepare, prompt, params)

    async def prepare_embedding(self, prompt: str | list[int]) -> PreparedPrompt:
        """An embedding's input tokenised and checked (``Engine.prepare_embedding``), in a
        worker thread as ``prepare`` does a prompt."""
        return await asyncio.to_thread(self.engine.prepare_embedding, prompt)

    async def constrain(self, params: SamplingParams) -> Any:
        """Compiled in a thread of its own: a slow grammar waits behind other grammars, never
        in front of prompts being tokenised (``prepare``'s threads)."""
        if params.structured is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(GRAMMAR_THREAD, self.engine.compile, params)

    def submit(self, prompt: PreparedPrompt | list[int], params: SamplingParams, constraint: Any = None,
               kv_transfer: KVTransferParams | None = None, first_token_ids: Sequence[int] = (),
               *, priority: int = 0) -> Handle:
        """Queue a request (``priority`` as ``Engine.add_request`` takes it); its deltas, then a
        ``Finished``, arrive through the handle. Raises
        ``Overloaded`` past the queue limit, ``EngineError`` once the engine has stopped; a
        prompt that can never be served arrives as a ``RequestRejected`` from the handle (token
        ids are checked on the engine's thread; a prompt from ``prepare`` was checked there)."""
        (handle,) = self._submit(prompt, params, constraint, kv_transfer, first_token_ids, priority)
        return handle

    def submit_choices(self, prompt: PreparedPrompt | list[int], params: SamplingParams,
                       constraint: Any = None, *, priority: int = 0) -> list[Handle]:
        """One request of ``params.n`` choices: the prompt computed once, its blocks shared;
        each choice counts against the queue limit and streams through its own handle."""
        return self._submit(prompt, params, constraint, None, (), priority)

    def submit_embedding(self, prompt: PreparedPrompt, pooling: PoolingParams) -> list[Handle]:
        """An embedding (its input from ``prepare_embedding``): prefill-only work beside the
        generating requests, its vector in its ``Finished`` output."""
        return self._submit(prompt, prompt.params, None, None, (), pooling=pooling)

    def _submit(self, prompt: PreparedPrompt | list[int], params: SamplingParams, constraint: Any,
                kv_transfer: KVTransferParams | None, first_token_ids: Sequence[int],
                priority: int = 0, pooling: PoolingParams | None = None) -> list[Handle]:
        loop = asyncio.get_running_loop()
        n = params.n
        with self._lock:
            if self._closed or not self.alive:
                raise EngineStopped(f"the engine has stopped: {self.fatal}" if self.fatal
                                    else "the server is shutting down")
            if self._in_flight + n > self.max_queue:
                raise Overloaded(f"{self._in_flight} requests in flight (server.max_queue = "
                                 f"{self.max_queue}); retry later")
            self._in_flight += n
        first = f"req-{next(self._ids)}"
        ids = [first] + [f"{first}.{i}" for i in range(1, n)]
        handles = [Handle(rid, lambda rid=rid: self._commands.put(Abort(rid))) for rid in ids]

        def sink_of(handle: Handle) -> Callable[[Any], None]:
            def sink(item: Any) -> None:
                try:
                    loop.call_soon_threadsafe(handle.items.put_nowait, item)
                except RuntimeError:            # the client's event loop is gone
                    pass
            return sink

        sinks = [sink_of(h) for h in handles]
        self._commands.put(Submit(first, prompt, params, sinks[0], kv_transfer, tuple(first_token_ids),
                                  constraint, tuple(zip(ids[1:], sinks[1:])), priority, pooling))
        return handles

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the engine's thread between steps (what must not race a step)."""
        self._commands.put(Call(fn))

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()``'s result (or what it raised), run on the engine's thread between steps."""
        if not self.alive:
            raise EngineStopped(f"the engine has stopped: {self.fatal}")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                done.set_result(value) if ok else done.set_exception(value)

        def job() -> None:
            try:
                result = (True, fn())
            except Exception as exc:
                result = (False, exc)
            try:
                loop.call_soon_threadsafe(settle, *result)
            except RuntimeError:            # the caller's event loop is gone
                pass

        self._commands.put(Call(job))
        return await done

    def fail_all(self, message: str) -> None:
        """End every open request with an error (shutdown past its deadline)."""
        self._commands.put(FailAll(message))

    # -- the engine's side (this thread) ---------------------------------------------------
    def _run(self) -> None:
        try:
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
                self.engine.expire_leases()
                self._safely(self.on_change)
        except BaseException as exc:        # the loop itself broke: nothing may hang on it
            with self._lock:
                self.fatal, self._closed = exc, True
            log.critical("the engine loop stopped: %s", exc, exc_info=exc)
            self._fail_open(f"the engine stopped: {exc}")
            self._refuse_queued(f"the engine stopped: {exc}")
            self._safely(self.on_fatal, exc)

    def _refuse_queued(self, message: str) -> None:
        """Answer every request still queued, once the loop no longer takes commands."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Submit):
                for sink in cmd.sinks:
                    self._release_slot()
                    sink(EngineStopped(message))

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, Submit):
            self._add(cmd)
        elif isinstance(cmd, Abort):
            self._end(cmd.request_id)
        elif isinstance(cmd, FailAll):
            self._fail_open(cmd.message)
        elif isinstance(cmd, Call):
            self._safely(cmd.fn)

    def _add(self, cmd: Submit) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id,
                                    kv_transfer=cmd.kv_transfer, first_token_ids=cmd.first_token_ids,
                                    constraint=cmd.constraint, choice_ids=[i for i, _ in cmd.choices],
                                    priority=cmd.priority, pooling=cmd.pooling)
        except Exception as exc:
            if not isinstance(exc, RequestRejected):        # the engine's fault, not the request's
                log.exception("adding request %s failed", cmd.request_id)
                exc = EngineError(f"the engine could not take the request: {exc}")
            for sink in cmd.sinks:
                self._release_slot()
                sink(exc)
            return
        self._sinks[cmd.request_id] = cmd.sink
        self._sinks.update(cmd.choices)

    def _step(self) -> None:
        try:
            result = self.engine.step_with_record()
        except StepFailed as exc:        # the engine has ended the step's requests ("error")
            log.exception("engine step failed")
            for request_id in exc.request_ids:
                self._error(request_id, f"the engine failed: {exc.__cause__}")
            if exc.had_running:             # new prompts failing alone may be their own fault
                self._count_failure(exc)
            return
        except Exception as exc:         # outside the backends: end everything in flight
            log.exception("engine step failed")
            self._fail_open(f"the engine failed: {exc}")
            self._count_failure(exc)
            return
        last = result.record                     # None: an empty step (K/V still on the way)
        if last is not None and last.decode_seqs:    # running requests advanced: not broken
            self._failed_steps = 0
        if self.on_step is not None and last is not None:
            self._safely(self.on_step, last)
        for d in result.deltas:
            sink = self._sinks.get(d.request_id)
            if sink is None:
                continue
            if d.error is not None:          # ended by the engine (its K/V never came)
                self._error(d.request_id, d.error)
                continue
            sink(d)
            if d.output is not None:
                sink(Finished(d.output))
                self._done(d.request_id, d.output)

    def _count_failure(self, exc: Exception) -> None:
        self._failed_steps += 1
        if self._failed_steps >= self.max_failed_steps:
            raise EngineError(f"{self._failed_steps} steps in a row failed; the last: {exc}") from exc

    def _end(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine (if it is still there) and forget its sink."""
        try:
            output = self.engine.abort(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)
            output = None
        if request_id in self._sinks:
            self._done(request_id, output)

    def _error(self, request_id: str, message: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink(EngineError(message))
            self._done(request_id, None)

    def _fail_open(self, message: str) -> None:
        for request_id in list(self._sinks):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
            self._error(request_id, message)

    def _done(self, request_id: str, output: RequestOutput | None) -> None:
        self._sinks.pop(request_id, None)
        if output is not None:
            self._safely(self.on_finish, output)
        self._release_slot()

    def _release_slot(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @staticmethod
    def _safely(fn: Callable[..., None] | None, *args: Any) -> None:
        """Callbacks (metrics) must not end the loop."""
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            log.exception("a server callback failed")
