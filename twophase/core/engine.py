"""The step loop as data flow:

    schedule -> build batches -> execute -> sample -> update (scheduler) -> output processing

``Scheduler.schedule`` decides who runs, ``batch.build`` turns that into the backends' batch
types, the ``Executor`` calls the backend(s), the sampler picks tokens, the scheduler applies
the step (the only writer of request state) and output processing turns its ``SeqUpdate`` values
into ``Delta`` values (text, stop strings) that may cross threads.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from twophase.contract import Backend, DecodeBatch, EngineLimits, PrefillBatch
from twophase.core import batch
from twophase.core.engine_values import EngineStats, PreparedPrompt, StepResult
from twophase.core.executor import Executor
from twophase.core.kv_manager import KVManager
from twophase.core.kv_transfer import KVConnector, KVTransferParams
from twophase.core.metrics import StepLog, StepRecord
from twophase.core.output_processor import OutputProcessor
from twophase.core.outputs import Delta, RequestOutput, RequestStats
from twophase.core.pooling import Pooler, PoolingConfig, PoolingParams, prepare_pooled
from twophase.core.proposer import Proposer
from twophase.core.request import Request, Status
from twophase.core.sampler import sample_step
from twophase.core.sampling_params import SamplingParams
from twophase.core.scheduler import Scheduler, SchedulerOutput
from twophase.errors import InvalidSamplingParam, RequestRejected, StepFailed, TwophaseError
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


def check_priority(priority: object) -> int:
    """``priority`` if it is an integer (a bool, float or string is refused, naming it)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        exc = RequestRejected(f"priority must be an integer, got {priority!r}")
        exc.param = "priority"
        raise exc
    return priority


class Engine:
    def __init__(self, prefill_backend: Backend, decode_backend: Backend, scheduler: Scheduler,
                 tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 decode_routes: Sequence[tuple[int, Backend]] = (), pooling: PoolingConfig | None = None):
        self.executor = Executor(prefill_backend, decode_backend, decode_routes)
        self.pooler = Pooler(prefill_backend, pooling)        # embeddings (core/pooling.py)
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

    def tier_stats(self) -> dict[str, float] | None:
        """The K/V host and disk tiers' counters (None: no tiers)."""
        return self.kv.tier_stats()

    @property
    def adapters(self) -> Any:
        """The ``LoraManager`` of the adapters it serves (None: none can be)."""
        return self.kv.adapters

    @property
    def limits(self) -> EngineLimits:
        """The most sequences and tokens one step takes, and the longest sequence."""
        s = self.scheduler
        return EngineLimits(s.max_num_seqs, s.budget, s.max_model_len)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler for this model (its tokenizer and vocabulary)."""
        return Grammars(self.tokenizer, self.vocab_size or 0, self.scheduler.eos_token_ids)

    # -- requests -------------------------------------------------------------------------
    @property
    def connector(self) -> KVConnector | None:
        return self.scheduler.connector

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> PreparedPrompt:
        """The prompt tokenised and checked against every limit ``params`` must meet: the one
        place a prompt is checked (``RequestRejected`` naming the limit). Reads constants only,
        so a server tokenises and refuses a huge prompt off the engine's thread, before it
        queues, and hands the result to ``add_request``."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            tok = self.tokenizer
            if tok is None:
                raise RequestRejected("this model has no tokenizer: give prompts as token ids")
            fewest = math.ceil(len(text) / tok.max_token_chars)
            if fewest > self.max_model_len - params.max_tokens:     # no need to tokenise it to know
                raise RequestRejected(
                    f"the prompt ({len(text)} characters, so at least {fewest} tokens) + "
                    f"max_tokens ({params.max_tokens}) exceeds the model's context of "
                    f"{self.max_model_len} tokens (model.max_model_len)")
            ids = tok.encode(check_text(text))
        else:
            ids = [int(t) for t in prompt]
        self.scheduler.admission.check(ids, params)
        return PreparedPrompt(tuple(ids), params, text)

    def add_request(self, prompt: str | Sequence[int] | PreparedPrompt,
                    params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None,
                    kv_transfer: KVTransferParams | None = None,
                    first_token_ids: Sequence[int] = (),
                    constraint: Constraint | None = None,
                    choice_ids: Sequence[str] = (), priority: int = 0,
                    pooling: PoolingParams | None = None) -> Request:
        """Queue a request; raises ``RequestRejected`` if it could never be served. The returned
        request is the engine's own: read it on the engine's thread only. A prompt from
        ``prepare`` is not checked again (``params``: None, or the ones it was prepared for).

        Disaggregated serving: ``kv_transfer`` with ``do_remote_decode`` keeps the prompt's
        blocks for a peer when the request finishes (its output carries ``kv_transfer_params``);
        with ``do_remote_prefill`` the prompt's blocks are pulled from the peer, and the request
        continues after ``first_token_ids`` (the tokens the peer sampled; its deltas and output
        hold only the tokens sampled here).

        A request with ``params.structured`` gets its grammar state here (``constraint``: one
        compiled already, off this thread, by ``grammars.constraint``).

        ``params.n`` choices: the returned request is choice 0, and the others (ids
        ``choice_ids``, else ``<request_id>.<i>``) wait in its ``forks`` until its prompt is
        computed; each is then a request of its own, with its own deltas and output.

        ``priority``: as vLLM's, the lower value starts first and is preempted last; equal
        priorities are served first come, first served. A request's choices share it.

        With ``pooling`` it is an embedding (``core/pooling.py``): prefill-only, never sampled;
        a prompt for it comes from ``prepare_embedding``, else is checked as one."""
        check_priority(priority)
        if pooling is not None:
            return self._add_pooled(prompt, pooling, request_id, arrival)
        if isinstance(prompt, PreparedPrompt):
            if params is not None and params != prompt.params:
                raise ValueError("the prompt was prepared for other SamplingParams: prepare it "
                                 "again with these, or pass params=None")
            params = prompt.params
        params = params or SamplingParams()
        self._check_transfer(params, kv_transfer, first_token_ids)
        request_id = self._new_id(request_id)
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare(prompt, params)
        ids, text = list(prompt.token_ids), prompt.text
        if params.structured is not None and constraint is None:
            constraint = self.compile(params)
        req = Request(request_id, ids, params, self.clock() if arrival is None else arrival, text,
                      priority)
        req.cache_root = self._cache_root(params)
        req.kv_transfer = kv_transfer
        req.constraint = constraint
        if constraint is not None:
            constraint.accept_all(first_token_ids)       # a peer sampled them under the grammar
        if first_token_ids:
            req.token_ids += [int(t) for t in first_token_ids]
            state = kv_transfer.generator_state if kv_transfer is not None else None
            if state is not None and req.generator is not None:
                req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        forks = self._choices(req, list(choice_ids), text)
        self.scheduler.add(req)
        for r in [req, *forks]:
            self.requests[r.request_id] = r
            self.output.add(r.request_id, text, ids, r.params, first_token_ids, index=r.index,
                            continues_on_peer=kv_transfer is not None and kv_transfer.do_remote_decode)
        return req

    def _cache_root(self, params: SamplingParams) -> bytes:
        """What a request's cached blocks are keyed by beside its tokens (its adapter, its
        ``cache_salt``); ``RequestRejected`` for an adapter this engine does not know."""
        salt = b"" if params.cache_salt is None else \
            hashlib.sha256(b"salt\0" + params.cache_salt.encode("utf-8", "surrogatepass")).digest()
        return self._adapter_root(params) + salt

    def _adapter_root(self, params: SamplingParams) -> bytes:
        if params.lora is None:
            return b""
        if self.adapters is None:
            raise RequestRejected(f"adapter {params.lora!r}: this engine serves no adapters (its "
                                  "backends do not apply them)")
        if params.lora not in self.adapters.known:
            known = ", ".join(sorted(self.adapters.known)) or "none"
            raise RequestRejected(f"no adapter named {params.lora!r} (known: {known})")
        root: bytes = self.adapters.cache_root(params.lora)
        return root

    def _check_transfer(self, params: SamplingParams, kv_transfer: KVTransferParams | None,
                        first_token_ids: Sequence[int]) -> None:
        """Refuse what a disaggregated request cannot do: its prompt is computed on the peer."""
        if kv_transfer is not None or first_token_ids:
            if params.n > 1:
                raise RequestRejected("n > 1 cannot be combined with kv_transfer_params: send "
                                      "one request a choice")
            if params.prompt_logprobs is not None:
                raise RequestRejected("prompt_logprobs cannot be combined with "
                                      "kv_transfer_params: the prompt is computed on the peer")
        if kv_transfer is not None:
            if self.connector is None:
                raise RequestRejected("kv_transfer_params: this engine has no KV connector")
            self.connector.check(kv_transfer)
        if len(first_token_ids) >= params.max_tokens:
            raise RequestRejected(f"{len(first_token_ids)} tokens already sampled leave none of "
                                  f"max_tokens ({params.max_tokens})")

    def _choices(self, req: Request, ids: list[str], text: str | None) -> list[Request]:
        """The other ``n - 1`` choices of ``req``, waiting on it: each with ``n = 1`` and seed
        ``seed + i``, and a grammar state of its own."""
        n = req.params.n
        if ids and len(ids) != n - 1:
            raise ValueError(f"{len(ids)} choice ids for n = {n}: give n - 1")
        ids = ids or [f"{req.request_id}.{i}" for i in range(1, n)]
        taken = [i for i in ids if i in self.requests or i == req.request_id]
        if taken or len(set(ids)) < len(ids):
            raise RequestRejected(f"request id {(taken or ids)[0]!r} is already in use")
        for i, rid in enumerate(ids, 1):
            params = req.params.choice(i)
            child = Request(rid, req.prompt_token_ids, params, req.times.arrival, text,
                            req.priority)
            child.cache_root = req.cache_root
            child.index, child.parent, child.status = i, req, Status.FORKING
            if params.structured is not None:
                child.constraint = self.compile(params)
            req.forks.append(child)
        return list(req.forks)

    def prepare_embedding(self, prompt: str | Sequence[int]) -> PreparedPrompt:
        """An embedding's input tokenised and checked (``RequestRejected`` naming ``input``),
        as ``prepare`` does a prompt's; thread-safe."""
        tok = self.tokenizer
        return prepare_pooled(prompt, None if tok is None else lambda t: tok.encode(check_text(t)),
                              self.vocab_size, self.max_model_len, self.scheduler.admission.never_fits)

    def _add_pooled(self, prompt: str | Sequence[int] | PreparedPrompt, pooling: PoolingParams,
                    request_id: str | None, arrival: float | None) -> Request:
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare_embedding(prompt)
        req = Request(self._new_id(request_id), list(prompt.token_ids), prompt.params,
                      self.clock() if arrival is None else arrival, prompt.text)
        self.pooler.add(req, pooling)
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self.output.add(req.request_id, prompt.text, list(prompt.token_ids), prompt.params)
        return req

    def _new_id(self, request_id: str | None) -> str:
        """``request_id``, or a free one where it is None; ``RequestRejected`` if it is in use."""
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        return request_id

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
        return self.step_with_record().deltas

    def step_with_record(self) -> StepResult:
        """One step: its deltas, and the record of what it computed (for a caller's metrics
        of this very step, which the step log's newest entry need not be)."""
        start = self.clock()
        out = self.scheduler.schedule(now=start)
        ended = [self._fail(r.request_id, why) for r, why in out.failed]
        if self.connector is not None:
            self.connector.load()          # pulled blocks, before any step may count them
        if out.empty:
            if self.connector is not None and self.connector.pulling:
                self.connector.wait(0.002)
            return StepResult(ended, None)
        # requests that computed a step before this one: if they fail too, the engine (not a
        # newcomer's prompt) is what breaks
        had_running = any(r.num_computed_tokens > 0 for r, _ in out.scheduled)
        try:
            with self.executor.glue():
                sampled_out, pooled = self.pooler.split(out)    # embeddings: a call of their own
                batches = batch.build(sampled_out, self.kv, self.executor.one_call(len(out.decodes)))
                masks = structured_masks.start(sampled_out)     # computed while the forward pass runs
                logits = self.executor.run(batches) if batches.calls else None
                self.pooler.run(pooled, self.kv)
                now = self.clock()                      # the step's time: its tokens exist
                sampled = {} if logits is None else sample_step(
                    logits, batches.rows, self.scheduler.eos_token_ids, out.drafts,
                    None if masks is None else masks.result())
                updates = self.scheduler.update_from_output(out, sampled, now)
                deltas = ended + self.output.process(updates,
                                                     lambda rid, why: self._retire(rid, why, now))
                deltas += self.pooler.finish(pooled, lambda rid: self.output.finish(
                    rid, "stop", self._retire(rid, "stop", now)))
        except Exception as exc:
            # a failed step must not leave half-updated requests behind: end them, free blocks
            failed = [r.request_id for r, _ in out.scheduled if r.request_id in self.requests]
            for request_id in failed:
                self.output.finish(request_id, "error", self._retire(request_id, "error"))
            failed += [d.request_id for d in ended]        # already ended: their sinks wait too
            raise StepFailed(f"the step failed: {exc}", failed, had_running) from exc
        record = self._record(out, start, now)
        self.steps.add(record)
        control = self.scheduler.spec_control
        if control is not None:
            control.learn(out.num_draft_tokens, sum(out.accepted.values()))
            if out.decodes and not out.prefills:
                control.observe(len(out.decodes), out.num_draft_tokens, now - start)
        return StepResult(deltas, record)

    def _fail(self, request_id: str, why: str) -> Delta:
        """End a request the engine could not serve (its K/V never came): an error delta."""
        output = self.output.finish(request_id, "error", self._retire(request_id, "error"))
        return Delta(request_id, [], "", [], "error", output, error=why)

    def _retire(self, request_id: str, reason: str, now: float | None = None) -> RequestStats:
        """Finish ``request_id`` in the scheduler (if it is not already) and forget it."""
        req = self.requests.pop(request_id)
        self.pooler.forget(request_id)
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

    # -- what callers outside the engine read -----------------------------------------------
    def stats(self) -> EngineStats:
        """The pool, the prefix cache and the queues now (cheap: a server reads it each step)."""
        kv, s = self.kv, self.scheduler
        return EngineStats(total_blocks=kv.pool.num_blocks, free_blocks=kv.num_free_blocks,
                           used_blocks=kv.num_used_blocks, prefix_queries=kv.queries,
                           prefix_hits=kv.hits, running=len(s.running), waiting=len(s.waiting),
                           num_steps=len(self.steps.records))

    def step_records(self) -> list[StepRecord]:
        """A copy of the step log since the last ``reset_stats`` (the newest 200,000 steps)."""
        return list(self.steps.records)

    def reset_stats(self) -> None:
        """Forget the step log and the prefix cache's counts: a report starts from here."""
        self.steps.clear()
        self.kv.queries = self.kv.hits = 0

    def set_proposer(self, proposer: Proposer) -> None:
        """Draft with ``proposer`` from the next step on, as many drafts a decode as before (the
        simulator drafts at a workload's acceptance rate in place of a draft model)."""
        self.scheduler.proposer = proposer

    # -- a backend's raw calls, outside any step -----------------------------------------------
    def prefill_logits(self, token_ids: Sequence[int],
                       chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, logits [n, vocab])`` for consecutive chunks of ``token_ids`` (``chunk``
        tokens each, else the token budget), from the prefill backend with logits at every
        position: what perplexity and agreement measure, as the model runs when serving. The
        K/V goes to blocks lent for the duration and taken back after (never published to the
        prefix cache), so the engine must be idle."""
        if self.has_unfinished():
            raise TwophaseError("the engine is busy: measure quality between runs")
        ids = [int(t) for t in token_ids]
        req = Request("prefill-logits", ids, SamplingParams(max_tokens=1), self.clock())
        if not self.kv.allocate(req, len(ids)):
            raise TwophaseError(f"{len(ids)} tokens need {self.kv.blocks_for(len(ids))} KV blocks; "
                                f"the pool has {self.kv.num_free_blocks} free")
        chunk = chunk or self.scheduler.budget
        try:
            for start in range(0, len(ids), chunk):
                n = min(chunk, len(ids) - start)
                b = batch.prefill_batch([(req, start, n)], self.kv)
                b.logits = "all"
                yield start, self.executor.prefill_backend.prefill(b).float().cpu()
        finally:
            self.kv.free(req)

    def schedule_batch(self, phase: Literal["prefill", "decode", "mixed"]
                       ) -> tuple[SchedulerOutput, PrefillBatch | DecodeBatch]:
        """Schedule the next step and build one backend call of it, without running it: its
        prefill chunks (``PrefillBatch``), its decodes (``DecodeBatch``), or both in one
        ``PrefillBatch``, the decodes as one-token chunks first ("mixed"). The conformance kit
        feeds it to the backend under test and to the reference. The step is never applied, so
        step this engine no more."""
        out = self.scheduler.schedule()
        if phase == "decode":
            if not out.decodes:
                raise TwophaseError("no decode was scheduled: step the requests past their prompts first")
            return out, batch.decode_batch(out.decodes, self.kv)
        items = [(r, r.num_computed_tokens, n) for r, n in out.prefills]
        if phase == "mixed":
            items = [(r, r.num_computed_tokens, 1) for r in out.decodes] + items
        if not items:
            raise TwophaseError("no prefill was scheduled: add a request first")
        return out, batch.prefill_batch(items, self.kv)

    def close(self) -> None:
        """Release the backends' resources; the pool's cached blocks and what the host tier
        holds go to disk, for the next start."""
        if self.kv.tiers is not None:
            self.kv.save_cached()
            self.kv.tiers.flush()
            self.kv.tiers.close()
        self.executor.close()
