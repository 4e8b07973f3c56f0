"""``ClusterLoop``: what the HTTP layer talks to when the engines run on Ray. It keeps the
interface of ``EngineLoop`` (``twophase.server.loop.Loop``), so ``twophase.server.app`` serves a
cluster with the same routes, streaming, errors and limits as one engine.

Replicas: each request goes to the Serve deployment, whose router picks the replica.
Disaggregated: the request runs on a prefill worker with ``max_tokens = 1`` and
``do_remote_decode`` (the first token streams to the client at once); then on a decode worker
with the ``kv_transfer_params`` the prefill worker returned, which pulls the prompt's blocks and
decodes the rest. A client that goes away aborts the request on whichever worker has it and
releases the prefill worker's lease; a worker that dies ends its requests with an error."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray

from twophase.cluster.host import Failure, Job
from twophase.core.engine import check_text
from twophase.core.handoff import continues_on_peer, first_text, first_token_params, joined, wants_decode_peer
from twophase.core.kv_params import KVTransferParams
from twophase.core.outputs import Delta
from twophase.core.sampling_params import SamplingParams
from twophase.errors import InvalidSamplingParam, RequestRejected
from twophase.server.loop import GRAMMAR_THREAD, EngineError, EngineStopped, Finished, Handle, Overloaded
from twophase.structured.constraint import Grammars, rejected

if TYPE_CHECKING:
    from twophase.cluster.launch import Cluster
    from twophase.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RESTART_WAIT_S = 60.0      # a worker Ray restarts loads its model again: tens of seconds


class ClusterLoop:
    def __init__(self, cluster: Cluster, tokenizer: Tokenizer | None, max_model_len: int,
                 max_queue: int):
        self.cluster, self.tokenizer = cluster, tokenizer
        self.max_model_len, self.max_queue = max_model_len, max_queue
        self._grammars: Grammars | None = None
        self.fatal: BaseException | None = None
        self._closed = False
        self._in_flight = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._tasks: set[asyncio.Task] = set()
        self._aio: asyncio.AbstractEventLoop | None = None     # the HTTP layer's event loop

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self, timeout: float = 10.0) -> bool:
        self._closed = True
        self.fail_all("the server is shutting down")
        return True

    def fail_all(self, message: str) -> None:
        """End every open request with ``message`` (any thread: the shutdown deadline's timer)."""
        if self._aio is None or self._aio.is_closed():
            return
        for t in list(self._tasks):
            self._aio.call_soon_threadsafe(t.cancel, message)

    async def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        return await asyncio.to_thread(self._prepare, prompt, params)

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids, and the limit every worker shares; the rest is the worker's to check."""
        limit = self.max_model_len - params.max_tokens
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: give the prompt as token ids")
            fewest = math.ceil(len(prompt) / self.tokenizer.max_token_chars)
            if fewest > limit:
                raise RequestRejected(f"the prompt ({len(prompt)} characters, so at least {fewest} "
                                      f"tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                      f"model's context of {self.max_model_len} tokens")
            prompt = self.tokenizer.encode(check_text(prompt))
        if len(prompt) > limit:
            raise RequestRejected(f"the prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                                  f"exceeds the model's context of {self.max_model_len} tokens "
                                  f"(model.max_model_len)")
        return list(prompt)

    async def constrain(self, params: SamplingParams) -> None:
        """Check the grammar here, for a 400 before any worker sees it; each worker compiles
        its own state (a grammar state does not cross processes)."""
        if params.structured is not None:
            await asyncio.get_running_loop().run_in_executor(GRAMMAR_THREAD, self._check_grammar, params)

    def _check_grammar(self, params: SamplingParams) -> None:
        if self._grammars is None:
            tok = self.tokenizer
            self._grammars = Grammars(tok, len(tok.vocabulary()) if tok else 0,
                                      getattr(tok, "eos_token_ids", ()))
        try:
            assert params.structured is not None
            self._grammars.check(params.structured)
        except InvalidSamplingParam as exc:
            raise rejected(exc) from None

    def submit(self, prompt: str | list[int], params: SamplingParams, constraint: Any = None, *,
               priority: int = 0) -> Handle:
        if self._closed:
            raise EngineStopped("the server is shutting down")
        if self._in_flight >= self.max_queue:
            raise Overloaded(f"{self._in_flight} requests in flight (server.max_queue = "
                             f"{self.max_queue}); retry later")
        assert not isinstance(prompt, str), "prepare() first"
        job = Job(f"{self._prefix}-{next(self._ids)}", list(prompt), params, priority=priority)
        task: asyncio.Task | None = None
        handle = Handle(job.request_id, lambda: task.cancel() if task is not None else None)
        self._in_flight += 1
        self._aio = asyncio.get_running_loop()
        task = self._aio.create_task(self._drive(job, handle))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)       # also for a task cancelled before it ran
        return handle

    def submit_choices(self, prompt: list[int], params: SamplingParams, constraint: Any = None, *,
                       priority: int = 0) -> list[Handle]:
        """``params.n`` requests, choice ``i`` with ``seed + i``: replicas do not share blocks,
        so each choice computes the prompt on the replica it lands on."""
        handles: list[Handle] = []
        try:
            for i in range(params.n):
                handles.append(self.submit(prompt, params.choice(i), constraint, priority=priority))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return handles

    def _task_done(self, task: asyncio.Task) -> None:
        self._in_flight -= 1
        self._tasks.discard(task)

    async def _drive(self, job: Job, handle: Handle) -> None:
        put = handle.items.put_nowait
        try:
            if self.cluster.disaggregated:
                await self._disaggregated(job, put)
            else:
                await self._replica(job, put)
        except asyncio.CancelledError as exc:      # the client went away, or shutdown (fail_all)
            put(EngineStopped(str(exc.args[0]) if exc.args else "the request was cancelled"))
        except Exception as exc:
            log.exception("request %s failed", job.request_id)
            put(EngineError(f"the request failed: {exc}"))

    async def _replica(self, job: Job, put) -> None:
        stream = self.cluster.handle.options(stream=True).generate.remote(job)
        try:
            async for item in stream:
                if not _emit(item, put):
                    return
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except ray.exceptions.RayError as exc:
            put(EngineError(f"the replica serving this request failed: {_reason(exc)}"))

    async def _disaggregated(self, job: Job, put) -> None:
        p = job.params
        prefill = self.cluster.pick("prefill", job.prompt_token_ids)
        peer = KVTransferParams(do_remote_decode=True) if wants_decode_peer(p) else None
        first = await self._one(prefill, dataclasses.replace(job, params=first_token_params(p), kv_transfer=peer),
                                put, "prefill")
        if first is None:
            return
        out = first.output
        assert out is not None
        kv = out.kv_transfer_params
        if not continues_on_peer(out):
            if kv:
                prefill.release_kv.remote(kv["remote_request_id"])
            put(first)
            put(Finished(out))
            return
        assert kv is not None
        put(dataclasses.replace(first, text=first_text(out, p), finish_reason=None, output=None))
        try:
            decode = self.cluster.pick("decode")
            rest = dataclasses.replace(job, kv_transfer=KVTransferParams.from_dict(kv),
                                       first_token_ids=tuple(first.token_ids))
            await self._one(decode, rest, put, "decode", lambda d: joined(out, d, p))
        finally:          # acknowledged by the decode side already, unless it failed or died
            prefill.release_kv.remote(kv["remote_request_id"])

    async def _one(self, worker: Any, job: Job, put, role: str, finish=None) -> Delta | None:
        """Stream ``job`` on ``worker``: its deltas go to the client (only the last one's output
        goes through ``finish``, which returns the output to send); returns the last delta, or
        None if the request ended without output (an error was put). A worker that Ray is
        restarting is waited for, up to ``RESTART_WAIT_S``, if it refused the request."""
        self.cluster.busy[worker] += 1
        deadline = time.monotonic() + RESTART_WAIT_S
        last = None
        try:
            while True:
                try:
                    async for ref in worker.generate.options(num_returns="streaming").remote(job):
                        item = await ref
                        if isinstance(item, Failure):
                            put(item.exception())
                            return None
                        last = item
                        if finish is None:
                            continue              # the prefill's one delta: the caller decides
                        if item.output is not None:
                            item = dataclasses.replace(item, output=finish(item.output))
                        _emit(item, put)
                    return last
                except ray.exceptions.ActorUnavailableError as exc:
                    # sent again only if Ray refused it because the worker was restarting; one
                    # that was running when its worker died ends (it may be what killed it)
                    if last is not None or not _refused_while_restarting(exc):
                        raise
                    if time.monotonic() > deadline:
                        put(Overloaded(f"the {role} worker is restarting; retry later ({_reason(exc)})"))
                        return None
                    await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            worker.abort.remote(job.request_id)
            raise
        except ray.exceptions.RayError as exc:
            put(EngineError(f"the {role} worker failed: {_reason(exc)}"))
            return None
        finally:
            self.cluster.busy[worker] -= 1


def _emit(item: Any, put) -> bool:
    """Hand one worker item to the client's handle; False once the request has ended."""
    if isinstance(item, Failure):
        put(item.exception())
        return False
    put(item)
    if item.output is not None:
        put(Finished(item.output))
        return False
    return True


def _refused_while_restarting(exc: BaseException) -> bool:
    """Ray's refusal of a task sent while the actor restarts ("The actor is restarting"), as
    opposed to a task that was running when it died ("The actor was restarted")."""
    return "is restarting" in str(exc)


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)        # a task's own exception, without Ray's traceback
    text = str(cause if cause is not None else exc).strip().splitlines()
    return text[-1] if cause is not None and text else text[0] if text else type(exc).__name__
