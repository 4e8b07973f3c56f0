"""The analytic cost of each phase, and what the hardware allows for it.

Counts only what bounds a step: the matmuls' FLOPs (2 per multiply-add; attention's QK and PV
included, norms, RoPE and softmax left out) and the bytes that must move from memory (every
weight once per step, each sequence's cached K/V once, the new K/V once; a sliding layer reads
only its window's K/V, and its queries attend to the window's keys only). A step cannot beat
``max(flops / peak, bytes / bandwidth)``: prefill sits on the compute side of that max, decode
at small batch on the memory side, until the batch reaches the *crossover* where it turns
compute-bound.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from twophase.arch import ModelArch
from twophase.cache.layout import state_spec
from twophase.models.param_counts import active_layer_params


def _pairs(n: float, depth: float, window: int) -> float:
    """(query, key) pairs of ``n`` queries after ``depth`` cached keys, each seeing the keys up
    to itself, at most ``window`` of them (0: no window)."""
    first, last = depth + 1, depth + n          # keys the first and the last query would see
    if not window or last <= window:
        return n * depth + n * (n + 1) / 2
    if first >= window:
        return n * window
    return (first + window) * (window - first + 1) / 2 + (last - window) * window


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
        """What a token's K/V holds in every attention layer (the pool's view; a read may take less)."""
        return len(self.arch.attention_layers) * self.layer_kv_bytes

    @cached_property
    def state_bytes(self) -> int:
        """One sequence's state in every state layer: a step reads it and writes it back once."""
        spec = state_spec(self.arch)
        return spec.bytes_per_sequence() if spec else 0

    def _state_flops(self, tokens: float) -> float:
        """The state layers' updates and reads over ``tokens`` (``StateLayerSpec.step_flops``)."""
        return sum(s.mixer.step_flops() for s in self.arch.layers if s.mixer is not None) * tokens

    @property
    def layer_kv_bytes(self) -> float:
        """Bytes one cached token takes in one layer: each K/V head's K and V, or one latent
        shared by every head (multi-head latent attention)."""
        from twophase.cache.layout import KVHeads

        kv = KVHeads.of(self.arch)
        return kv.planes * kv.num_kv_heads * kv.head_dim * self.kv_bytes

    @cached_property
    def _windows(self) -> tuple[tuple[int, int], ...]:
        """``(window or 0, layers with it)``: full layers and each sliding window."""
        return tuple(Counter(s.attention.window or 0 for s in self.arch.layers if s.attends).items())

    def keys_read(self, n: float, depth: float) -> float:
        """K/V rows a chunk of ``n`` tokens after ``depth`` cached ones reads, summed over the
        layers: a sliding layer only its window's (its first query sees ``window`` keys, each
        later one a key further on)."""
        return sum(k * (min(depth + n, w + n - 1) if w else depth + n) for w, k in self._windows)

    def keys_seen(self, n: float, depth: float) -> float:
        """(query, key) pairs of the chunk's attention, summed over the layers."""
        return sum(k * _pairs(n, depth, w) for w, k in self._windows)

    def _attention_flops(self, pairs: float) -> float:
        """QK and PV over ``pairs`` (query, key) pairs of one layer's heads."""
        a = self.arch
        return 4 * a.num_heads * a.head_dim * pairs

    def prefill(self, n: int, depth: int = 0, seqs: int = 1) -> Cost:
        """``seqs`` chunks of ``n`` tokens, each after ``depth`` cached ones (logits: last token)."""
        L = self.arch.num_layers
        flops = seqs * (2 * n * L * self.layer_params + 2 * self.head_params
                        + self._attention_flops(self.keys_seen(n, depth)) + self._state_flops(n))
        moved = self.weight_bytes_per_step + seqs * (self.keys_read(n, depth) * self.layer_kv_bytes
                                                     + 2 * self.state_bytes)
        return Cost(flops, moved)

    def decode(self, batch: int, context: int) -> Cost:
        """One token for each of ``batch`` sequences with ``context`` tokens cached."""
        L = self.arch.num_layers
        flops = batch * (2 * (L * self.layer_params + self.head_params)
                         + self._attention_flops(self.keys_seen(1, context)) + self._state_flops(1))
        moved = self.weight_bytes_per_step + batch * (self.keys_read(1, context) * self.layer_kv_bytes
                                                      + 2 * self.state_bytes)
        return Cost(flops, moved)

    def verify(self, batch: int, context: int, tokens: float) -> Cost:
        """A speculative verify pass: ``tokens`` per sequence (its decode and its drafts, on
        average) after ``context`` cached ones, for one read of the weights."""
        L = self.arch.num_layers
        flops = batch * (tokens * 2 * (L * self.layer_params + self.head_params)
                         + self._attention_flops(self.keys_seen(tokens, context)) + self._state_flops(tokens))
        moved = self.weight_bytes_per_step + batch * (self.keys_read(tokens, context) * self.layer_kv_bytes
                                                      + 2 * self.state_bytes)
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
