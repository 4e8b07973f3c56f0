"""Which tokens run in the next step: continuous batching under a token budget.

Decode-first (the default): every running sequence in decode gets its one token first, because
a long prompt prefilled in one go would stall them all for its whole duration; the rest of the
budget goes to prefill chunks, partially-prefilled requests before waiting ones. Since the
budget must exceed ``max_num_seqs``, decodes never take all of it and waiting requests always
progress. ``prefill-first`` inverts the order; ``chunked_prefill = false`` only schedules whole
prompts. When the pool runs out, the newest running request is preempted: its blocks are freed
and it is recomputed later (nothing is dropped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from twophase.core.kv_manager import KVManager
from twophase.core.request import Request, Status


@dataclass
class SchedulerOutput:
    decodes: list[Request] = field(default_factory=list)             # one token each
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "decode-first", chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._left = max_num_batched_tokens

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._left = self.budget                 # tokens still unscheduled this step
        if self.policy == "decode-first":
            self._schedule_decodes(out)
            self._schedule_prefills(out)
        else:
            self._schedule_prefills(out)
            self._schedule_decodes(out)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        for req in list(self.running):
            if self._left == 0:
                break
            if req.status is not Status.RUNNING or not req.in_decode or self._scheduled(req, out):
                continue      # (a preempted request re-admitted this step may look like a decode)
            if self._allocate_or_preempt(req, 1, out):
                out.decodes.append(req)
                self._left -= 1

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
            if self._allocate_or_preempt(req, n, out):
                out.prefills.append((req, n))
                self._left -= n
        if out.preempted:      # the pool is short: admit nothing new this step
            return
        while self.waiting and self._left > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed = self.kv.computed_blocks(req) if self.chunked_prefill else []
            cached = len(computed) * self.kv.block_size
            pending = req.num_tokens - cached
            n = min(pending, self._left)
            if n < pending and not self.chunked_prefill:
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

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting the newest running requests
        until they fit. False if ``req`` itself had to be preempted."""
        while not self.kv.allocate(req, n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            self._left += self._unschedule(victim, out)
            if victim is req:
                return False
        return True

    @staticmethod
    def _scheduled(req: Request, out: SchedulerOutput) -> bool:
        return req in out.decodes or any(r is req for r, _ in out.prefills)

    @staticmethod
    def _unschedule(req: Request, out: SchedulerOutput) -> int:
        if req in out.decodes:
            out.decodes.remove(req)
            return 1
        for i, (r, n) in enumerate(out.prefills):
            if r is req:
                del out.prefills[i]
                return n
        return 0

    def preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and put it at the head of the queue to be recomputed."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Retire ``req`` (finished or aborted) and free its blocks at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
