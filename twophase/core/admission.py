"""Admission: whether a request could ever be served (checked when it arrives, so a request
that never fits is refused at once rather than queued for ever), and whether a waiting one may
start now.

Starting now keeps ``watermark_blocks`` free for the running sequences' growth: a newcomer
that would take the last blocks forces preemptions (recomputation) within a few steps, so it
waits instead. Preemption by recompute stays the last resort.
"""

from __future__ import annotations

from twophase.core.kv_manager import KVManager
from twophase.core.params import SamplingParams
from twophase.errors import RequestRejected


class Admission:
    def __init__(self, kv: KVManager, max_model_len: int, token_budget: int,
                 chunked_prefill: bool, vocab_size: int | None = None, watermark_blocks: int = 0):
        self.kv = kv
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.chunked_prefill = chunked_prefill
        self.vocab_size = vocab_size
        self.watermark_blocks = watermark_blocks

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
        blocks = self.kv.blocks_for(total)
        if blocks > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the pool has "
                f"{self.kv.pool.num_blocks} (cache.num_blocks)")
        if not self.chunked_prefill and total > self.token_budget:
            raise RequestRejected(
                f"prompt + max_tokens = {total} tokens exceeds scheduler.max_num_batched_tokens "
                f"({self.token_budget}) with chunked prefill off")

    def may_start(self, new_blocks: int) -> bool:
        """May a waiting request that needs ``new_blocks`` more blocks start this step?"""
        return self.kv.num_free_blocks - new_blocks >= self.watermark_blocks
