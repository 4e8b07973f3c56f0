"""The step loop as data flow:

    schedule -> build batches -> execute -> sample -> update (scheduler) -> output processing

``Scheduler.schedule`` decides who runs, ``batch.build`` turns that into the backends' batch
types, the ``Executor`` calls the backend(s), the sampler picks tokens, the scheduler applies
the step (the only writer of request state) and output processing turns its ``SeqUpdate`` values
into ``Delta`` values (text, stop strings) that may cross threads.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from twophase.contract import Backend
from twophase.core import batch
from twophase.core.executor import Executor
from twophase.core.kv_manager import KVManager
from twophase.core.kv_transfer import KVConnector, KVTransferParams
from twophase.core.metrics import StepLog, StepRecord
from twophase.core.output_processor import OutputProcessor
from twophase.core.outputs import Delta, RequestOutput, RequestStats
from twophase.core.params import SamplingParams
from twophase.core.request import Request
from twophase.core.sampler import sample_step
from twophase.core.scheduler import Scheduler, SchedulerOutput
from twophase.errors import InvalidSamplingParam, RequestRejected, StepFailed
from twophase.structured import masks as structured_masks
from twophase.structured.constraint import Constraint, Grammars, rejected

if TYPE_CHECKING:
    from twophase.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def check_text(text: str) -> str:
    """Text a tokenizer can take: a lone surrogate (which JSON's "\\ud800" makes) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestRejected(f"the text is not valid Unicode ({exc.reason} at character "
                              f"{exc.start})") from None
    return text


class Engine:
    def __init__(self, prefill_backend: Backend, decode_backend: Backend, scheduler: Scheduler,
                 tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 decode_routes: Sequence[tuple[int, Backend]] = ()):
        self.executor = Executor(prefill_backend, decode_backend, decode_routes)
        self.scheduler = scheduler
        self.output = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.clock = clock
        self.requests: dict[str, Request] = {}          # unfinished requests by id
        self.steps = StepLog()
        self._ids = itertools.count()

    @property
    def kv(self) -> KVManager:
        return self.scheduler.kv

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler for this model (its tokenizer and vocabulary)."""
        return Grammars(self.tokenizer, self.vocab_size or 0, self.scheduler.eos_token_ids)

    # -- requests -------------------------------------------------------------------------
    @property
    def connector(self) -> KVConnector | None:
        return self.scheduler.connector

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None,
                    kv_transfer: KVTransferParams | None = None,
                    first_token_ids: Sequence[int] = (),
                    constraint: Constraint | None = None) -> Request:
        """Queue a request; raises ``RequestRejected`` if it could never be served. The returned
        request is the engine's own: read it on the engine's thread only.

        Disaggregated serving: ``kv_transfer`` with ``do_remote_decode`` keeps the prompt's
        blocks for a peer when the request finishes (its output carries ``kv_transfer_params``);
        with ``do_remote_prefill`` the prompt's blocks are pulled from the peer, and the request
        continues after ``first_token_ids`` (the tokens the peer sampled; its deltas and output
        hold only the tokens sampled here).

        A request with ``params.structured`` gets its grammar state here (``constraint``: one
        compiled already, off this thread, by ``grammars.constraint``)."""
        params = params or SamplingParams()
        if kv_transfer is not None:
            if self.connector is None:
                raise RequestRejected("kv_transfer_params: this engine has no KV connector")
            self.connector.check(kv_transfer)
        if len(first_token_ids) >= params.max_tokens:
            raise RequestRejected(f"{len(first_token_ids)} tokens already sampled leave none of "
                                  f"max_tokens ({params.max_tokens})")
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: give prompts as token ids")
            ids = self.tokenizer.encode(check_text(prompt))
        else:
            ids = [int(t) for t in prompt]
        text = prompt if isinstance(prompt, str) else None
        if params.structured is not None and constraint is None:
            constraint = self.compile(params)
        req = Request(request_id, ids, params, self.clock() if arrival is None else arrival, text)
        req.kv_transfer = kv_transfer
        req.constraint = constraint
        if constraint is not None:
            constraint.accept_all(first_token_ids)       # a peer sampled them under the grammar
        if first_token_ids:
            req.token_ids += [int(t) for t in first_token_ids]
            state = kv_transfer.generator_state if kv_transfer is not None else None
            if state is not None and req.generator is not None:
                req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self.scheduler.add(req)
        self.requests[request_id] = req
        self.output.add(request_id, text, ids, params, first_token_ids,
                        hands_off=kv_transfer is not None and kv_transfer.do_remote_decode)
        return req

    def compile(self, params: SamplingParams) -> Constraint:
        """A fresh grammar state for ``params.structured`` (``RequestRejected`` naming what is
        wrong). Thread-safe: a server compiles off the engine's thread and passes it in."""
        assert params.structured is not None
        try:
            return self.grammars.constraint(params.structured)
        except InvalidSamplingParam as exc:
            raise rejected(exc) from None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks: its output so far, or None if it is unknown
        or already done."""
        if request_id not in self.requests:
            return None
        return self.output.finish(request_id, "abort", self._retire(request_id, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------
    def expire_leases(self) -> None:
        """Return to the pool the blocks kept for peers that never took them."""
        if self.connector is not None:
            self.connector.expire()

    def step(self) -> list[Delta]:
        start = self.clock()
        out = self.scheduler.schedule(now=start)
        ended = [self._fail(r.request_id, why) for r, why in out.failed]
        if self.connector is not None:
            self.connector.load()          # pulled blocks, before any step may count them
        if out.empty:
            if self.connector is not None and self.connector.pulling:
                self.connector.wait(0.002)
            return ended
        # requests that computed a step before this one: if they fail too, the engine (not a
        # newcomer's prompt) is what breaks
        veterans = any(r.num_computed_tokens > 0 for r, _ in out.scheduled)
        try:
            with self.executor.glue():
                batches = batch.build(out, self.kv, self.executor.one_call(len(out.decodes)))
                masks = structured_masks.start(out)     # computed while the forward pass runs
                logits = self.executor.run(batches)
                now = self.clock()                      # the step's time: its tokens exist
                sampled = sample_step(logits, batches.rows, self.scheduler.eos_token_ids, out.drafts,
                                      None if masks is None else masks.result())
                updates = self.scheduler.update_from_output(out, sampled, now)
                deltas = ended + self.output.process(updates,
                                                     lambda rid, why: self._retire(rid, why, now))
        except Exception as exc:
            # a failed step must not leave half-updated requests behind: end them, free blocks
            failed = [r.request_id for r, _ in out.scheduled if r.request_id in self.requests]
            for request_id in failed:
                self.output.finish(request_id, "error", self._retire(request_id, "error"))
            failed += [d.request_id for d in ended]        # already ended: their sinks wait too
            raise StepFailed(f"the step failed: {exc}", failed, veterans) from exc
        self.steps.add(self._record(out, start, now))
        control = self.scheduler.spec_control
        if control is not None:
            control.learn(out.num_draft_tokens, sum(out.accepted.values()))
            if out.decodes and not out.prefills:
                control.observe(len(out.decodes), out.num_draft_tokens, now - start)
        return deltas

    def _fail(self, request_id: str, why: str) -> Delta:
        """End a request the engine could not serve (its K/V never came): an error delta."""
        output = self.output.finish(request_id, "error", self._retire(request_id, "error"))
        return Delta(request_id, [], "", [], "error", output, error=why)

    def _retire(self, request_id: str, reason: str, now: float | None = None) -> RequestStats:
        """Finish ``request_id`` in the scheduler (if it is not already) and forget it."""
        req = self.requests.pop(request_id)
        if req.times.finished is None:
            now = self.clock() if now is None else now
        else:
            now = None                     # finished in update_from_output: keep that time
        self.scheduler.finish(req, reason, now)
        return RequestStats.of(req)

    def _record(self, out: SchedulerOutput, start: float, now: float) -> StepRecord:
        width = max((len(p.token_ids) for p in out.drafts.values()), default=0)
        drafted_at, kept_at = [0] * width, [0] * width
        for rid, proposal in out.drafts.items():
            kept = out.accepted.get(rid, 0)
            for j in range(len(proposal.token_ids)):
                drafted_at[j] += 1
                kept_at[j] += j < kept
        return StepRecord(start=start, duration=now - start,
                          prefill_tokens=out.num_prefill_tokens,
                          prefill_seqs=len(out.prefills), decode_seqs=len(out.decodes),
                          kv_blocks_used=self.kv.num_used_blocks,
                          preemptions=len(out.preempted), recomputed_tokens=out.recomputed_tokens,
                          draft_tokens=out.num_draft_tokens,
                          drafted_seqs=len(out.drafts), accepted_tokens=sum(out.accepted.values()),
                          propose_s=out.propose_s, drafted_at=tuple(drafted_at), kept_at=tuple(kept_at))

    def close(self) -> None:
        """Release the backends' resources."""
        self.executor.close()
