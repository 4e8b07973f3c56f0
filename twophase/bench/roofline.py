"""The analytic cost of each phase, and what the hardware allows for it.

Counts only what bounds a step: the matmuls' FLOPs (2 per multiply-add; attention's QK and PV
included, norms, RoPE and softmax left out) and the bytes that must move from memory (every
weight once per step, each sequence's cached K/V once, the new K/V once). A step cannot beat
``max(flops / peak, bytes / bandwidth)``: prefill sits on the compute side of that max, decode
at small batch on the memory side, until the batch reaches the *crossover* where it turns
compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from twophase.arch import ModelArch
from twophase.models.params import active_layer_params


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes

    def bound_s(self, peak_flops: float, bandwidth: float) -> float:
        """The fastest this work can run under the ceilings."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)


@dataclass(frozen=True)
class CostModel:
    arch: ModelArch
    weight_bytes: float          # per parameter (4 for fp32, 2 for bf16)
    kv_bytes: float              # per K or V element

    @property
    def layer_params(self) -> float:
        """Matrix weights a token multiplies in a layer (a MoE's routed experts only)."""
        return active_layer_params(self.arch)

    @property
    def head_params(self) -> int:
        return self.arch.vocab_size * self.arch.hidden_size

    @property
    def weight_bytes_per_step(self) -> float:
        return (self.arch.num_layers * self.layer_params + self.head_params) * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        a = self.arch
        return a.num_layers * 2 * a.num_kv_heads * a.head_dim * self.kv_bytes

    def _attention_flops(self, query_positions: float) -> float:
        """QK and PV for queries that see ``query_positions`` keys in all."""
        a = self.arch
        return 4 * a.num_layers * a.num_heads * a.head_dim * query_positions

    def prefill(self, n: int, depth: int = 0, seqs: int = 1) -> Cost:
        """``seqs`` chunks of ``n`` tokens, each after ``depth`` cached ones (logits: last token)."""
        L = self.arch.num_layers
        flops = seqs * (2 * n * L * self.layer_params + 2 * self.head_params
                        + self._attention_flops(n * depth + n * (n + 1) / 2))
        moved = self.weight_bytes_per_step + seqs * (depth + n) * self.kv_bytes_per_token
        return Cost(flops, moved)

    def decode(self, batch: int, context: int) -> Cost:
        """One token for each of ``batch`` sequences with ``context`` tokens cached."""
        L = self.arch.num_layers
        flops = batch * (2 * (L * self.layer_params + self.head_params)
                         + self._attention_flops(context + 1))
        moved = self.weight_bytes_per_step + batch * (context + 1) * self.kv_bytes_per_token
        return Cost(flops, moved)

    def verify(self, batch: int, context: int, tokens: float) -> Cost:
        """A speculative verify pass: ``tokens`` per sequence (its decode and its drafts, on
        average) after ``context`` cached ones, for one read of the weights."""
        L = self.arch.num_layers
        flops = batch * tokens * (2 * (L * self.layer_params + self.head_params)
                                  + self._attention_flops(context + (tokens + 1) / 2))
        moved = self.weight_bytes_per_step + batch * (context + tokens) * self.kv_bytes_per_token
        return Cost(flops, moved)

    def speculative_intensity(self, context: int, summary: dict) -> dict[str, float]:
        """What speculation did to decode's arithmetic intensity at batch 1, from a run's
        speculative summary: the tokens a verify pass computed per weight read, those it kept,
        and the FLOP/byte of each (kept: the work that became output)."""
        computed = 1 + summary["draft_tokens"] / summary["verify_passes"]
        kept = summary["mean_accepted_length"]
        verify = self.verify(1, context, computed).intensity
        return {"tokens_computed_per_pass": computed, "mean_accepted_length": kept,
                "decode_intensity_b1": self.decode(1, context).intensity,
                "verify_intensity_b1": verify, "kept_intensity_b1": verify * kept / computed}

    def decode_crossover(self, context: int, peak_flops: float, bandwidth: float,
                         limit: int = 1 << 16) -> int | None:
        """The smallest batch at which decode turns compute-bound (None: never, below
        ``limit``: each sequence's K/V keeps the intensity under the ridge)."""
        ridge = peak_flops / bandwidth
        lo, hi = 1, limit
        if self.decode(hi, context).intensity < ridge:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode(mid, context).intensity >= ridge:
                hi = mid
            else:
                lo = mid + 1
        return lo
