"""The reference line: the same measurements through HF ``transformers`` (``generate`` in static
batches), in the same process and run, so reports state ratios rather than absolute times.

The model is read from the same HF folder twophase loads (config.json + safetensors), or, for
random weights, built from the same architecture with HF's own random initialisation (speed
does not depend on the weights' values).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch

from twophase.bench.serving import TimedRequest


class _TokenClock:
    """A ``generate`` streamer that only notes when each put arrives: the prompt first, then
    each step's tokens (moved to the host, so a GPU step is over by then)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_step_s(self, steps: int) -> float:
        """The median decode step: gaps between tokens after the first (which ends prefill),
        the first gap left out (it warms caches)."""
        gaps = [b - a for a, b in zip(self.times[1:], self.times[2:])]
        if len(gaps) < steps:
            raise RuntimeError(f"HF decode: {len(gaps)} decode steps timed, expected {steps}")
        return statistics.median(gaps[1:] or gaps)


class HFBaseline:
    name = "hf"

    def __init__(self, llm):
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        m = llm.model
        self.device = torch.device(llm.config.phases()[0].device)
        if m.weights == "random":
            a = m.arch
            cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                              intermediate_size=a.intermediate_size, num_hidden_layers=a.num_layers,
                              num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                              head_dim=a.head_dim, max_position_embeddings=a.max_position_embeddings,
                              tie_word_embeddings=a.tie_word_embeddings)
            default = torch.get_default_dtype()
            torch.set_default_dtype(m.dtype)          # initialise in place, in the model's dtype
            try:
                with torch.device(self.device):
                    self.model = LlamaForCausalLM(cfg).eval()
            finally:
                torch.set_default_dtype(default)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                m.weights, dtype=m.dtype).to(self.device).eval()
        self.vocab = m.arch.vocab_size

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _ids(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return ids, mask

    @torch.inference_mode()
    def prefill_round(self, n: int, depth: int, salt: int) -> float:
        """One forward over ``n`` tokens (after ``depth`` cached ones in a KV cache)."""
        from twophase.bench.sweeps import prefill_prompt

        prompt = prefill_prompt(n, depth, salt, self.vocab)
        past = None
        if depth:
            past = self.model(torch.tensor([prompt[:depth]], device=self.device),
                              use_cache=True).past_key_values
        x = torch.tensor([prompt[depth:]], device=self.device)
        self._sync()
        t = time.perf_counter()
        with warnings.catch_warnings():                # the argument's name differs by version
            warnings.simplefilter("ignore", FutureWarning)
            self.model(x, past_key_values=past, use_cache=past is not None, logits_to_keep=1)
        self._sync()
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode_round(self, batch: int, context: int, steps: int, salt: int) -> float:
        """Median seconds of ``generate``'s decode steps at ``batch``, each timed as it happens
        (the gap between two tokens reaching the streamer), as the engine's sweep times its
        steps; the first decode step is left out, as there. A difference of two ``generate``
        calls once came out negative at batch 32, hidden as zero."""
        from twophase.bench.sweeps import decode_prompts

        ids, mask = self._ids(decode_prompts(batch, context, self.vocab))
        clock = _TokenClock()
        self._sync()
        self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                            max_new_tokens=steps + 1, min_new_tokens=steps + 1, streamer=clock)
        return clock.decode_step_s(steps)

    @torch.inference_mode()
    def serve(self, requests: list[TimedRequest], batch_size: int) -> dict[str, Any]:
        """All requests (arrival times ignored: static batches need them all up front), in
        static batches of length-sorted prompts; only requested tokens count as output."""
        rows = [r for r in requests if isinstance(r.prompt, list)]
        order = sorted(rows, key=lambda r: len(r.prompt))
        t0 = time.perf_counter()
        for k in range(0, len(order), batch_size):
            group = order[k:k + batch_size]
            ids, mask = self._ids([r.prompt for r in group])
            new = max(r.max_tokens for r in group)
            self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
        self._sync()
        wall = time.perf_counter() - t0
        out = sum(r.max_tokens for r in rows)
        return {"requests": len(rows), "wall_s": wall, "batch_size": batch_size,
                "request_throughput": len(rows) / wall, "output_tokens": out,
                "output_tokens_per_s": out / wall}

