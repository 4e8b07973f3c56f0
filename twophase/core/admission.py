"""Admission: whether a request could ever be served (checked when it arrives, so a request
that never fits is refused at once rather than queued for ever), and whether a waiting one may
start now.

Starting now keeps free the blocks the running sequences are expected to grow into: a
newcomer that takes them forces preemptions (recomputation) within a few steps, so it waits
instead. The expectation is each running sequence's whole prompt and a fraction ``ratio`` of the
``max_tokens`` it has yet to generate, as SGLang reserves: most
requests stop well before ``max_tokens``, so reserving all of it would idle the pool. The ratio
starts at ``RATIO_START``, decays towards ``RATIO_MIN`` with each step that preempted no one, and
jumps back up with each preemption, so a workload whose outputs run long learns to reserve more;
an engine that runs dry starts again from ``RATIO_START`` (the same requests scheduled again are
scheduled the same way). Preemption by recompute stays the last resort.
"""

from __future__ import annotations

from collections.abc import Iterable

from twophase.core.kv_manager import KVManager
from twophase.core.request import Request
from twophase.core.sampling_params import SamplingParams
from twophase.errors import RequestRejected

RATIO_START = 0.5           # of each running sequence's remaining tokens, reserved at first
RATIO_MIN = 0.1
RATIO_DECAY = 0.002         # per step without a preemption
RATIO_STEP_UP = 0.25        # per preemption


class Admission:
    def __init__(self, kv: KVManager, max_model_len: int, token_budget: int,
                 chunked_prefill: bool, vocab_size: int | None = None, reserve: bool = True,
                 max_num_seqs: int | None = None):
        self.kv = kv
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.chunked_prefill = chunked_prefill
        self.vocab_size = vocab_size
        self.reserve = reserve
        self.max_num_seqs = max_num_seqs
        self.ratio = RATIO_START

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestRejected``, naming the limit, if ``ids`` + ``params`` can never run."""
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
        n = params.n
        if self.max_num_seqs is not None and n > self.max_num_seqs:
            raise RequestRejected(f"n = {n} choices need {n} sequences but a step runs at most "
                                  f"{self.max_num_seqs} (scheduler.max_num_seqs)")
        chunk = self.token_budget if self.chunked_prefill else total
        # n choices share the prompt's whole blocks: each holds its own tail and output
        blocks = self.kv.peak_blocks(total, chunk) + (n - 1) * self.kv.peak_blocks(
            params.max_tokens + self.kv.block_size, chunk)
        if blocks > self.kv.pool.num_blocks:
            what = f"prompt + max_tokens = {total} tokens" + (f", {n} choices," if n > 1 else "")
            raise RequestRejected(
                f"{what} needs {blocks} KV blocks but the pool has "
                f"{self.kv.pool.num_blocks} (cache.num_blocks)")
        if not self.chunked_prefill and total > self.token_budget:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens exceeds scheduler.max_num_batched_tokens "
                f"({self.token_budget}) with chunked prefill off")

    def never_fits(self, n: int) -> str | None:
        """Why a sequence of ``n`` tokens, all prefilled and none sampled (an embedding), can
        never run here, or None."""
        blocks = self.kv.peak_blocks(n, self.token_budget if self.chunked_prefill else n)
        if blocks > self.kv.pool.num_blocks:
            return f"{n} tokens need {blocks} KV blocks but the pool has {self.kv.pool.num_blocks} (cache.num_blocks)"
        if not self.chunked_prefill and n > self.token_budget:
            return (f"{n} tokens exceed scheduler.max_num_batched_tokens ({self.token_budget}) "
                    f"with chunked prefill off")
        return None

    def may_start(self, new_blocks: int, running: Iterable[Request]) -> bool:
        """May a waiting request that needs ``new_blocks`` more blocks start this step, beside
        the ``running`` sequences?"""
        return self.kv.num_free_blocks - new_blocks >= self.watermark(running)

    def watermark(self, running: Iterable[Request]) -> int:
        """Free blocks kept for the running sequences' expected growth."""
        if not self.reserve:
            return 0
        need = 0
        for r in running:
            left = r.params.max_tokens - r.num_output_tokens
            expected = r.num_tokens + int(self.ratio * left + 0.999)
            need += self.kv.growth_blocks(r, expected)
        return need

    def idle(self) -> None:
        """Nothing runs or waits: the next burst starts from the first ratio."""
        self.ratio = RATIO_START

    def stepped(self, preemptions: int) -> None:
        """After a step's scheduling: reserve more after preemptions, a little less otherwise."""
        if preemptions:
            self.ratio = min(1.0, self.ratio + RATIO_STEP_UP * preemptions)
        else:
            self.ratio = max(RATIO_MIN, self.ratio - RATIO_DECAY)
