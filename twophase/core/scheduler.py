"""Which tokens run in the next step: continuous batching under a token budget.

Decode-first (the default): every running sequence in decode gets its one token first, because
a long prompt prefilled in one go would stall them all for its whole duration; the rest of the
budget goes to prefill chunks, partially-prefilled requests before waiting ones. Since the
budget must exceed ``max_num_seqs``, decodes never take all of it and waiting requests always
progress. ``prefill-first`` inverts the order; ``chunked_prefill = false`` only schedules whole
prompts. When the pool runs out, the newest running request is preempted: its blocks are freed
and it is recomputed later (nothing is dropped).

Priorities, as vLLM takes them: a lower value starts first (``waiting.py``), the running request
of the largest value is the first preempted, and a waiting request of higher priority than a
running one that cannot start preempts it, so a flood of low-priority requests never starves
it. With equal priorities this is first come, first served.

The scheduler is the only writer of request state: ``schedule`` decides who runs,
``update_from_output`` applies what the step computed and sampled (computed lengths, prefix
publication, new tokens, stop rules, freeing), ``finish`` retires a request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from twophase.core.admission import Admission
from twophase.core.kv_manager import KVManager
from twophase.core.kv_transfer import KVConnector
from twophase.core.outputs import SampledTokens, SeqUpdate
from twophase.core.proposer import Proposal, Proposer
from twophase.core.request import Request, Status
from twophase.core.spec_control import SpecController
from twophase.core.stop import check_stop
from twophase.core.waiting import WaitingQueue


@dataclass
class SchedulerOutput:
    decodes: list[Request] = field(default_factory=list)             # one token each, + drafts
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    preempted: list[Request] = field(default_factory=list)
    recomputed_tokens: int = 0                 # computed tokens the preemptions threw away
    drafts: dict[str, Proposal] = field(default_factory=dict)       # decodes verified this step
    propose_s: float = 0.0                                           # time spent drafting them
    accepted: dict[str, int] = field(default_factory=dict)          # drafts kept (after the step)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # K/V pulls that failed

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.drafts.values())

    def tokens_of(self, req: Request) -> int:
        """Tokens a decode computes this step: its own, and its drafts."""
        proposal = self.drafts.get(req.request_id)
        return 1 + (len(proposal.token_ids) if proposal else 0)

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        """Every scheduled sequence with the tokens it computes this step."""
        return [(r, self.tokens_of(r)) for r in self.decodes] + self.prefills


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "decode-first", chunked_prefill: bool = True, *,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (),
                 vocab_size: int | None = None, proposer: Proposer | None = None,
                 num_spec_tokens: int = 0, spec_control: SpecController | None = None,
                 reserve: bool = True, connector: KVConnector | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposer, self.num_spec_tokens = proposer, num_spec_tokens if proposer else 0
        self.spec_control = spec_control if proposer else None    # "auto": drafts per decode
        self.admission = Admission(kv, max_model_len, max_num_batched_tokens, chunked_prefill,
                                   vocab_size, reserve, max_num_seqs)
        self.connector = connector                # K/V from and for other engines
        self.waiting = WaitingQueue()               # by priority, then arrival
        self.running: list[Request] = []
        self.loading: list[Request] = []           # admitted, their K/V on the way from a peer
        self.num_preemptions = 0
        self._left = max_num_batched_tokens

    def add(self, req: Request) -> None:
        """Queue ``req``, which ``Engine.prepare`` has checked could ever be served (through
        ``admission.check``: one check a prompt, wherever it was tokenised)."""
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Who runs next and how many tokens each; ``now`` stamps first-scheduled times."""
        out = SchedulerOutput()
        self._left = self.budget                 # tokens still unscheduled this step
        if self.loading:
            self._take_pulled(out)
        if self.policy == "decode-first":
            self._schedule_decodes(out)
            self._schedule_prefills(out)
        else:
            self._schedule_prefills(out)
            self._schedule_decodes(out)
        pool_short = len(out.preempted)      # what the reserve learns from (not priority's)
        self._preempt_for_priority(out)
        self._schedule_drafts(out)           # last: from what decodes and prefill left over
        self.admission.stepped(pool_short)
        if now is not None:
            for req, _ in out.scheduled:
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = now
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledTokens],
                           now: float) -> list[SeqUpdate]:
        """Apply a computed step: each scheduled sequence's new K/V is in the pool (publish its
        full blocks), and sequences that were sampled take their tokens, one at a time through
        the stop rules (a speculative run of several stops at the first that ends it)."""
        updates = []
        for req, n in out.scheduled:
            got = sampled.get(req.request_id)
            if got is not None and got.prompt_logprobs is not None:
                self._take_prompt_logprobs(req, *got.prompt_logprobs)
            proposal = out.drafts.get(req.request_id)
            kept = 0
            if proposal is not None and got is not None:
                # the pending token and every draft were computed; the drafts after the first
                # one the target did not keep are rolled back (their slots overwritten later)
                kept = len(got.token_ids) - 1
                n = 1 + kept
                if kept < len(proposal.token_ids) and self.kv.state_slots:
                    # a state cannot drop the rejected drafts: back to the state before the
                    # step, and the kept tokens computed again as a chunk in the next step
                    self.kv.restore_state(req)
                    n = 0
            req.num_computed_tokens += n
            if proposal is not None:
                self.kv.truncate(req, req.num_computed_tokens)
            reason, appended = self._append(req, got.token_ids if got is not None else [], now)
            if proposal is not None:
                req.num_draft_tokens += len(proposal.token_ids)
                out.accepted[req.request_id] = min(kept, appended)   # what a stop left of them
                req.num_accepted_tokens += out.accepted[req.request_id]
            self.kv.cache_computed(req)   # after the tokens: a block hashes the tokens it holds
            self.kv.release_outside_window(req)
            if req.forks:
                self._fork(req)
            if reason is not None:
                self.finish(req, reason, now)
            if got is not None and got.token_ids:
                updates.append(self._update(req, got, appended, reason))
        return updates

    def _append(self, req: Request, tokens: list[int], now: float) -> tuple[str | None, int]:
        """Take sampled tokens one at a time through the stop rules: why ``req`` ends (or None)
        and how many it took."""
        for i, token in enumerate(tokens, 1):
            req.token_ids.append(token)
            if req.constraint is not None:
                req.constraint.accept(token)
            req.times.token_times.append(now)
            reason = check_stop(req, self.max_model_len, self.eos_token_ids)
            if reason is not None:
                return reason, i
        return None, len(tokens)

    @staticmethod
    def _update(req: Request, got: SampledTokens, appended: int,
                reason: str | None) -> SeqUpdate:
        """What the output side hears of a step's tokens; the first carries the prompt's
        log-probabilities."""
        first = req.params.prompt_logprobs is not None and req.num_output_tokens == appended
        return SeqUpdate(req.request_id, got.token_ids[:appended], (got.logprobs or [])[:appended],
                         req.num_output_tokens, reason, list(req.prompt_logprobs) if first else None)

    @staticmethod
    def _take_prompt_logprobs(req: Request, first: int, entries: list) -> None:
        """Keep a chunk's prompt log-probabilities (from position ``first``) that ``req`` lacks:
        a prompt computed again after a preemption gives them again."""
        have = len(req.prompt_logprobs)
        if first <= have < first + len(entries):
            req.prompt_logprobs += entries[have - first:]

    # -- n choices ------------------------------------------------------------------------------
    def fork_point(self, req: Request) -> int:
        """Where ``req``'s choices part: the prompt's last whole block (each choice computes the
        rest itself, at least one token, whose logits it samples its first token from)."""
        bs = self.kv.block_size
        return (req.num_prompt_tokens - 1) // bs * bs

    def _cut(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``start``, ended where the KV manager saves a
        state, and, for a request with choices waiting, at their fork point."""
        n = self.kv.cut_chunk(start, n)
        if req.forks:
            f = self.fork_point(req)
            if start < f < start + n:
                n = f - start
        return n

    def _fork(self, req: Request) -> None:
        """Once ``req`` has computed its prompt up to the fork point, each choice waiting on it
        takes those blocks (one reference more each, no copy; its state copied, in a model with
        state layers) and runs from there. A choice that finds no sequence slot or free blocks
        waits as a request of its own (nothing is lost; a prefix hit may still share)."""
        f = self.fork_point(req)
        if req.num_computed_tokens < f:
            return
        forks, req.forks = req.forks, []
        for child in forks:
            child.parent = None
            room = len(self.running) + len(self.loading) < self.max_num_seqs
            if f and room and self.kv.fork(req, child, f):
                child.num_computed_tokens = child.num_cached_tokens = f
                child.prompt_logprobs = req.prompt_logprobs[:f + 1]
                child.status = Status.RUNNING
                self.running.append(child)
            else:
                child.status = Status.WAITING
                self.waiting.add(child, front=True)

    def _release_forks(self, req: Request) -> None:
        """``req`` ended before its choices forked: they go on as requests of their own."""
        for child in reversed(req.forks):
            child.parent, child.status = None, Status.WAITING
            self.waiting.add(child, front=True)
        req.forks = []

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        for req in list(self.running):
            if self._left == 0:
                break
            if req.status is not Status.RUNNING or not req.in_decode or self._scheduled(req, out):
                continue      # (a preempted request re-admitted this step may look like a decode)
            if self._allocate_or_preempt(req, 1, out):
                out.decodes.append(req)
                self._left -= 1

    def _schedule_drafts(self, out: SchedulerOutput) -> None:
        """Drafts for the scheduled decodes, from the budget and free blocks that decodes and
        prefill left: speculation never preempts anyone nor slows a prompt down."""
        if self.proposer is None or not out.decodes:
            return
        plan = self.spec_control.plan(out.decodes) if self.spec_control else {}
        t0 = time.perf_counter()
        reqs, ks, left = [], [], self._left
        for req in out.decodes:
            k = self._draft_room(req, min(left, plan.get(req.request_id, self.num_spec_tokens)))
            if k > 0:
                reqs.append(req)
                ks.append(k)
                left -= k
        proposals = self.proposer.propose(reqs, ks) if reqs else []
        for req, k, proposal in zip(reqs, ks, proposals):
            n = min(len(proposal.token_ids), k)
            if n and self.kv.allocate(req, 1 + n):       # blocks for the drafts, if free
                out.drafts[req.request_id] = Proposal(
                    proposal.token_ids[:n], None if proposal.probs is None else proposal.probs[:n])
                self.kv.keep_state(req)
                self._left -= n
        out.propose_s = time.perf_counter() - t0

    def _draft_room(self, req: Request, room: int) -> int:
        """Drafts ``req`` may have: at most ``num_spec_tokens``, what the budget leaves, and
        what its ``max_tokens`` and the context allow (the verify pass adds one token more)."""
        return max(0, min(self.num_spec_tokens, room,
                          req.params.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        # requests already running whose prompt is not fully computed (earlier chunks done)
        for req in list(self.running):
            if self._left == 0:
                return
            if req.status is not Status.RUNNING or req.in_decode or self._scheduled(req, out):
                continue
            n = min(req.num_pending_tokens, self._left)
            if n < req.num_pending_tokens and not self.chunked_prefill:
                continue
            n = self._cut(req, req.num_computed_tokens, n)
            if self._allocate_or_preempt(req, n, out):
                out.prefills.append((req, n))
                self._left -= n
        if not out.preempted:      # else the pool is short: admit nothing new this step
            self._admit(out)

    def _admit(self, out: SchedulerOutput) -> None:
        """Waiting requests start, in order, while the budget, the pool and admission allow."""
        while (self.waiting and self._left > 0
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            req = self.waiting[0]
            external = self.connector.external_tokens(req) if self.connector else 0
            if external:
                if not self._start_pull(req, external):
                    return
                continue
            # a prompt whose log-probabilities are asked for computes every position: no hit
            hit = self.chunked_prefill and not req.wants_prompt_logprobs
            computed = self.kv.computed_blocks(req) if hit else []
            cached = self.kv.hit_tokens(computed)
            pending = req.num_tokens - cached
            n = min(pending, self._left)
            if n < pending and not self.chunked_prefill:
                return
            n = self._cut(req, cached, n)
            if req.forks and len(self.running) + len(self.loading) + 1 + len(req.forks) > self.max_num_seqs:
                return                       # its choices need sequence slots too
            if not self.admission.may_start(self.kv.blocks_needed(req, n, computed),
                                            self.running + self.loading):
                return
            if not self.kv.allocate(req, n, computed):
                return
            self.waiting.popleft()
            if req.num_preemptions == 0:       # a recompute's hits are not new traffic
                self.kv.record_lookup(req.num_tokens, cached)
            req.num_computed_tokens = cached
            req.num_cached_tokens = max(req.num_cached_tokens, cached)
            req.status = Status.RUNNING
            self.running.append(req)
            out.prefills.append((req, n))
            self._left -= n
            if req.forks and cached >= self.fork_point(req):
                self._fork(req)        # nothing to share yet, or a prefix hit reached the point

    def _start_pull(self, req: Request, external: int) -> bool:
        """Admit ``req`` with blocks for the ``external`` tokens a peer computed, and pull them;
        it computes nothing until they arrive."""
        assert self.connector is not None
        if not self.admission.may_start(self.kv.blocks_needed(req, external), self.running + self.loading):
            return False
        if not self.kv.allocate(req, external):
            return False
        self.waiting.popleft()
        req.status = Status.LOADING
        self.loading.append(req)
        self.connector.start_pull(req, external)
        return True

    def _take_pulled(self, out: SchedulerOutput) -> None:
        """Requests whose K/V arrived run from this step on (the connector writes the blocks
        before it computes); a failed pull recomputes the prompt here or ends the request."""
        assert self.connector is not None
        done = self.connector.pulled()
        for req, n in done.ready:
            self.loading.remove(req)
            req.kv_transfer = None
            req.num_computed_tokens = n
            req.status = Status.RUNNING
            self.running.append(req)
        for req, why in done.failed:
            req.kv_transfer = None
            if self.connector.on_failure == "recompute":
                self.loading.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
            else:
                out.failed.append((req, why))          # the engine ends it ("error")

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting running requests (``_victim``
        first) until they fit. False if ``req`` itself had to be preempted."""
        while not self.kv.allocate(req, n):
            victim = self._victim()
            self._preempt_scheduled(victim, out)
            if victim is req:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to preempt first: the lowest priority (largest value), the
        newest among equals."""
        return max(reversed(self.running), key=lambda r: r.priority)

    def _preempt_scheduled(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt ``victim``, taking back the tokens it was scheduled this step."""
        out.recomputed_tokens += victim.num_computed_tokens
        self.preempt(victim)
        out.preempted.append(victim)
        self._left += self._unschedule(victim, out)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """The waiting head could not start this step (``max_num_seqs``, the budget, the pool
        or admission refused it): while a running request has a lower priority (larger value),
        preempt it (``_victim`` first) and admit again, as vLLM's priority policy does. At most
        once a request running now: an admitted request never outranks the waiting ones, so
        the bound only matters if the queue's order were broken (a step, never a hang)."""
        for _ in range(len(self.running)):
            if not (self.waiting and self.running):
                return
            victim = self._victim()
            if victim.priority <= self.waiting[0].priority:
                return
            self._preempt_scheduled(victim, out)
            self._admit(out)

    @staticmethod
    def _scheduled(req: Request, out: SchedulerOutput) -> bool:
        return req in out.decodes or any(r is req for r, _ in out.prefills)

    @staticmethod
    def _unschedule(req: Request, out: SchedulerOutput) -> int:
        if req in out.decodes:
            n = out.tokens_of(req)
            out.decodes.remove(req)
            out.drafts.pop(req.request_id, None)
            return n
        for i, (r, n) in enumerate(out.prefills):
            if r is req:
                del out.prefills[i]
                return n
        return 0

    def preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and queue it to be recomputed, in front of the waiting
        requests of its priority."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)

    def finish(self, req: Request, reason: str, now: float | None = None) -> None:
        """Retire ``req`` (finished, aborted or failed) and free its blocks at once. On a
        request already finished this only changes the reason (a stop string found in the text
        of the step that reached ``max_tokens`` makes it "stop")."""
        req.finish_reason = reason
        if req.status is Status.FINISHED:
            return
        if self.proposer is not None:
            self.proposer.release(req)
        if req.forks:
            self._release_forks(req)
        if req.status is Status.RUNNING:
            if self.connector is not None:
                req.kv_handoff = self.connector.request_finished(req)
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.FORKING:
            assert req.parent is not None
            req.parent.forks.remove(req)
            req.parent = None
        elif req.status is Status.LOADING:
            self.loading.remove(req)
            assert self.connector is not None
            self.connector.cancel(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        if now is not None:
            req.times.finished = now
        if not self.has_work():
            self.admission.idle()
