"""What one step costs on a device: the roofline's split of its work into FLOPs and bytes
(``twophase.bench.roofline.CostModel``), turned into seconds.

    compute  = FLOPs / (peak × compute efficiency × tp)
    memory   = bytes / (bandwidth × bandwidth efficiency × tp)
    comm     = 2 all-reduces a layer over tp devices (tp > 1 only)
    host     = overhead a step + a sequence's × sequences + a K/V byte's × K/V bytes read
               + an attention FLOP's × attention FLOPs
    step     = max(compute, memory) × factor(tokens) + comm + host

``factor`` is 1 but where a fit measured a step of few tokens off the roofline's line (a CPU
GEMM tiled for some row counts: ``DeviceSpec.token_factors``).

FLOPs: 2 × active parameters × tokens for the matmuls, the LM head once a sequence (logits of
its last token), and attention's QK and PV over each chunk's context (quadratic in a prefill
chunk). Bytes: the weights once a step as stored, every sequence's cached K/V read once and the
new K/V written (a sliding layer's: its window's only). Each chunk's share of those goes to its
phase: a one-token chunk after cached tokens is a decode, any other a prefill (the weights' read
split by tokens).

Tensor parallelism over ``tp`` devices (Megatron's split: attention heads and the MLP's inner
dimension across devices) divides each step's FLOPs and bytes evenly and adds two all-reduces a
layer of the step's activations (``tokens × hidden`` 16-bit values), each a ring's
``2 (tp - 1) / tp`` of it over the link plus the link's latency, not overlapped with compute.
A prompt's K/V handed to a decode worker crosses the same link (``transfer_s``).

The terms beyond the fixed overhead are fitted on the CPU, where a backend's attention over a
paged pool (gathers, per-sequence calls, kernels slower than its matmuls) and its per-sequence
work cost more than the roofline gives them; on GPUs they are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twophase.arch import ModelArch
from twophase.bench.roofline import CostModel
from twophase.simulate.devices import DeviceSpec

# bytes per parameter as the weights are stored: q4 is 4-bit codes with a 16-bit scale and
# minimum each block of 32 (MatMulNBits, GGUF Q4_1): 4 + 32 / 32 bits
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "q4": 0.625}


@dataclass(frozen=True)
class StepCost:
    seconds: float
    compute_s: float
    memory_s: float
    prefill_flops: float
    decode_flops: float
    prefill_bytes: float
    decode_bytes: float
    comm_s: float = 0.0

    @property
    def flops(self) -> float:
        return self.prefill_flops + self.decode_flops

    @property
    def bytes(self) -> float:
        return self.prefill_bytes + self.decode_bytes

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class StepCostModel:
    def __init__(self, arch: ModelArch, device: DeviceSpec, weight_dtype: str, kv_dtype_bytes: float,
                 tp: int = 1):
        self.arch, self.device, self.tp = arch, device, tp
        self.roof = roof = CostModel(arch, WEIGHT_BYTES[weight_dtype], kv_dtype_bytes)
        # the roofline's terms, read once (each reading walks the model's tensors): a chunk of n
        # tokens after d cached costs n·matmul + head + (n·d + n(n+1)/2)·attention FLOPs
        self.weight_bytes = roof.weight_bytes_per_step
        self.layer_kv_bytes = roof.layer_kv_bytes
        self._matmul = 2 * arch.num_layers * roof.layer_params
        self._head = 2 * roof.head_params
        self._attention = roof._attention_flops(1.0)
        self._state, self.state_bytes = roof._state_flops(1.0), roof.state_bytes

    def kv_read(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Bytes of cached K/V the chunks' attention reads."""
        return sum(self.roof.keys_read(n, d) for n, d in chunks) * self.layer_kv_bytes

    def attention_flops(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The chunks' attention FLOPs (QK and PV over each one's keys)."""
        return self._attention * sum(self.roof.keys_seen(n, d) for n, d in chunks)

    def chunk_flops(self, n: int, depth: int) -> float:
        """``CostModel.prefill(n, depth).flops``, from the terms read once (a state layer's
        delta rule included)."""
        return (n * self._matmul + self._head + self._attention * self.roof.keys_seen(n, depth)
                + self._state * n)

    def step(self, chunks: Sequence[tuple[int, int]]) -> StepCost:
        """The cost of one backend call over ``chunks``: ``(tokens, cached tokens before them)``
        a sequence (a decode is ``(1, context - 1)``)."""
        flops = {"prefill": 0.0, "decode": 0.0}
        kv = {"prefill": 0.0, "decode": 0.0}
        tokens = {"prefill": 0, "decode": 0}
        for n, depth in chunks:
            phase = "decode" if n == 1 and depth > 0 else "prefill"
            flops[phase] += self.chunk_flops(n, depth)
            kv[phase] += self.roof.keys_read(n, depth) * self.layer_kv_bytes + 2 * self.state_bytes   # read, written
            tokens[phase] += n
        total = tokens["prefill"] + tokens["decode"]
        w = self.weight_bytes
        moved = {p: kv[p] + (w * tokens[p] / total if total else 0.0) for p in kv}
        d, tp = self.device, self.tp
        compute_s = (flops["prefill"] + flops["decode"]) / (d.peak_flops * d.compute_efficiency * tp)
        memory_s = (moved["prefill"] + moved["decode"]) / (d.bandwidth * d.bandwidth_efficiency * tp)
        comm_s = self.all_reduce_s(total)
        host_s = (d.step_overhead_s + d.seq_overhead_s * len(chunks) + d.kv_byte_s * (kv["prefill"] + kv["decode"])
                  + d.attention_flop_s * self.attention_flops(chunks))
        seconds = max(compute_s, memory_s) * d.token_factor(total) + comm_s + host_s
        return StepCost(seconds, compute_s, memory_s, flops["prefill"], flops["decode"],
                        moved["prefill"], moved["decode"], comm_s)

    def all_reduce_s(self, tokens: int) -> float:
        """Two ring all-reduces a layer of ``tokens × hidden`` 16-bit activations over ``tp``
        devices (none on one)."""
        tp, d = self.tp, self.device
        if tp == 1 or not tokens:
            return 0.0
        size = tokens * self.arch.hidden_size * 2
        one = 2 * (tp - 1) / tp * size / (d.link_bandwidth * d.link_efficiency) + d.link_latency_s
        return 2 * self.arch.num_layers * one

    def transfer_s(self, nbytes: float) -> float:
        """Moving ``nbytes`` (a prompt's K/V) to a peer device over the link."""
        d = self.device
        return nbytes / (d.link_bandwidth * d.link_efficiency) + d.link_latency_s
