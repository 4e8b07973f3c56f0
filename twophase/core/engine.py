"""The step loop: schedule, build the batch, call the backend(s), sample, stop, free.

One backend serving both phases gets ONE call a step: a mixed step is a single ``prefill`` whose
chunks include the decodes as one-token chunks (they ride on the chunk's read of the weights); a
step with decodes only is one ``decode`` call. Phases routed to different backends make two
calls a step, over the same KV pool.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from twophase.backends.base import Backend, DecodeBatch, PrefillBatch
from twophase.core.detokenizer import IncrementalDetokenizer
from twophase.core.kv_manager import KVManager
from twophase.core.metrics import StepRecord, StepLog
from twophase.core.params import SamplingParams
from twophase.core.request import Request
from twophase.core.sampler import sample
from twophase.core.scheduler import Scheduler, SchedulerOutput
from twophase.errors import RequestRejected

if TYPE_CHECKING:
    from twophase.models.tokenizer import Tokenizer


@dataclass
class Delta:
    """What one step produced for one request (the streaming unit)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    request: Request


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run torch's CPU ops on ``n`` threads inside the block (``None``: as they are)."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Engine:
    def __init__(self, prefill_backend: Backend, decode_backend: Backend, kv: KVManager,
                 scheduler: Scheduler, tokenizer: Tokenizer | None, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), clock: Callable[[], float] = time.perf_counter,
                 vocab_size: int | None = None):
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.one_call = (prefill_backend is decode_backend
                         and prefill_backend.capabilities().mixed_batches)
        # where no backend computes with torch, torch only glues a step together: one thread
        self.glue_threads = 1 if all(b.capabilities().own_threads
                                     for b in (prefill_backend, decode_backend)) else None
        self.kv = kv
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.steps = StepLog()
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> Request:
        """Queue a request; raises ``RequestRejected`` if it could never be served."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: give prompts as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self._check_admissible(ids, params)
        req = Request(request_id, ids, params, self.clock() if arrival is None else arrival, text)
        self.requests[request_id] = req
        if self.tokenizer is not None:
            self.detok[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(req)
        return req

    def _check_admissible(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.vocab_size or float("inf")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise RequestRejected(f"stop token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context of {self.max_model_len} tokens (model.max_model_len)")
        blocks = self.kv.blocks_for(total)
        if blocks > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the pool has "
                f"{self.kv.pool.num_blocks} (cache.num_blocks)")
        if not self.scheduler.chunked_prefill and total > self.scheduler.budget:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens exceeds scheduler.max_num_batched_tokens "
                f"({self.scheduler.budget}) with chunked prefill off")

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        start = self.clock()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        for req in itertools.chain(sched.decodes, (r for r, _ in sched.prefills)):
            if req.times.first_scheduled is None:
                req.times.first_scheduled = start
        try:
            with torch_threads(self.glue_threads):
                rows = self._run(sched)
                now = self.clock()
                deltas = self._postprocess(rows, now)
        except Exception:
            # a failed step must not leave half-updated requests behind: end them, free blocks
            for req in itertools.chain(sched.decodes, (r for r, _ in sched.prefills)):
                if not req.finished:
                    self._finish(req, "error")
            raise
        self.steps.add(StepRecord(start=start, duration=now - start,
                                  prefill_tokens=sched.num_prefill_tokens,
                                  prefill_seqs=len(sched.prefills), decode_seqs=len(sched.decodes),
                                  kv_blocks_used=self.kv.num_used_blocks,
                                  preemptions=len(sched.preempted)))
        return deltas

    def _run(self, sched: SchedulerOutput) -> list[tuple[Request, int, torch.Tensor]]:
        """Call the backend(s); return (request, tokens computed, logits row) per sequence."""
        chunks = [(r, r.num_computed_tokens, n) for r, n in sched.prefills]
        decodes = [(r, r.num_computed_tokens, 1) for r in sched.decodes]
        if self.one_call and chunks:
            items = decodes + chunks
            logits = self.prefill_backend.prefill(self._prefill_batch(items))
            return [(r, n, logits[i]) for i, (r, _, n) in enumerate(items)]
        rows = []
        if chunks:
            logits = self.prefill_backend.prefill(self._prefill_batch(chunks))
            rows += [(r, n, logits[i]) for i, (r, _, n) in enumerate(chunks)]
        if decodes:
            logits = self.decode_backend.decode(self._decode_batch(sched.decodes))
            rows += [(r, 1, logits[i]) for i, r in enumerate(sched.decodes)]
        return rows

    def _tables(self, reqs: list[Request]) -> torch.Tensor:
        tables = [self.kv.block_table(r) for r in reqs]
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)

    def _slots(self, req: Request, start: int, n: int) -> list[int]:
        table, bs = self.kv.block_table(req), self.kv.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _prefill_batch(self, items: list[tuple[Request, int, int]]) -> PrefillBatch:
        tokens, positions, slots = [], [], []
        for req, start, n in items:
            tokens += req.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += self._slots(req, start, n)
        return PrefillBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=self._tables([r for r, _, _ in items]),
            context_lens=torch.tensor([s + n for _, s, n in items], dtype=torch.long),
            query_lens=[n for _, _, n in items],
            start_positions=[s for _, s, _ in items])

    def _decode_batch(self, reqs: list[Request]) -> DecodeBatch:
        pos = [r.num_computed_tokens for r in reqs]
        return DecodeBatch(
            token_ids=torch.tensor([r.token_ids[p] for r, p in zip(reqs, pos)], dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor([self._slots(r, p, 1)[0] for r, p in zip(reqs, pos)],
                                      dtype=torch.long),
            block_tables=self._tables(reqs),
            context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long))

    def _postprocess(self, rows, now: float) -> list[Delta]:
        to_sample = []
        for req, n, row in rows:
            req.num_computed_tokens += n
            self.kv.cache_computed(req)
            if req.num_computed_tokens == req.num_tokens:   # the prompt (or decode) is complete
                to_sample.append((req, row))
        if not to_sample:
            return []
        logits = torch.stack([row for _, row in to_sample])
        reqs = [r for r, _ in to_sample]
        tokens, logprobs = sample(logits, reqs, self.eos_token_ids)
        return [self._append(req, tok, lp, now) for req, tok, lp in zip(reqs, tokens, logprobs)]

    def _append(self, req: Request, token: int, logprobs, now: float) -> Delta:
        req.token_ids.append(token)
        req.times.token_times.append(now)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        p = req.params
        detok = self.detok.get(req.request_id)
        new_text = detok.push(token) if detok else ""
        reason = None
        if req.num_output_tokens >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None and detok is not None:
            new_text += detok.flush()
        text, hit = self._release(req, new_text, final=reason is not None)
        if hit:
            reason = "stop"
        req.text += text
        if reason is not None:
            self._finish(req, reason, now)
        return Delta(req.request_id, [token], text, reason is not None, reason, req)

    def _release(self, req: Request, new_text: str, final: bool) -> tuple[str, bool]:
        """The text that may go out now, and whether a stop string ended the request.

        With stop strings, the last ``len(longest) - 1`` characters are held back: a stop string
        may begin in them, and text that has been streamed cannot be taken back."""
        p = req.params
        if not p.stop:
            return new_text, False
        window = req.held_text + new_text
        if req.num_output_tokens >= p.min_tokens:
            cut = min((i for i in (window.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.held_text = ""
                return window[:cut], True
        keep = 0 if final else max(len(s) for s in p.stop) - 1
        split = max(0, len(window) - keep)
        req.held_text = window[split:]
        return window[:split], False

    def _finish(self, req: Request, reason: str, now: float | None = None) -> None:
        self.scheduler.finish(req, reason)
        req.times.finished = self.clock() if now is None else now
        self.detok.pop(req.request_id, None)

    def release(self, request_id: str) -> Request | None:
        """Forget a finished request (the server calls this once it has replied)."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]
        return req
