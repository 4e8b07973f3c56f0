"""The devices a simulation runs on: peak compute and memory bandwidth, and the share of each
a serving engine reaches.

GPU peaks are the datasheets' dense 16-bit tensor-core figures (sparsity's doubled figure is not
what inference gets) and their HBM bandwidth:

- H100 SXM 80GB: 989 TFLOP/s BF16 dense, 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet)
- H100 NVL 94GB: 835 TFLOP/s BF16 dense, 3.9 TB/s (same datasheet, NVL column)
- H200 SXM 141GB: 989 TFLOP/s BF16 dense, 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet)
- A100 SXM 80GB: 312 TFLOP/s BF16 dense, 2.039 TB/s; A100 40GB: 312, 1.555 TB/s (NVIDIA A100
  datasheet)
- L40S: 362 TFLOP/s BF16 dense, 864 GB/s (NVIDIA L40S datasheet)
- L4: 121 TFLOP/s BF16 dense, 300 GB/s (NVIDIA L4 datasheet)

Efficiencies are typical published figures, not measurements of any one card: prefill GEMMs
reach about 50-60% of dense peak end to end (model FLOPs utilization as reported for serving
prefill and LLM training at scale, e.g. PaLM's 46-57%; cuBLAS alone reaches ~70%), so 0.55;
decode kernels stream weights and K/V at about 70-85% of HBM bandwidth (STREAM-like copies reach
~90% on H100), so 0.8. The per-step overhead (scheduling, batch building, sampling and kernel
launches around the forward pass) is an assumption of 1 ms a step, of the order eager-Python
engines with CUDA graphs show at small batch.

Links between the devices of one node, each direction (NVIDIA's NVLink figures are both
directions together): H100 SXM and H200 SXM NVLink 4, 900 GB/s -> 450; H100 NVL's NVLink bridge
600 -> 300; A100 SXM NVLink 3, 600 -> 300; L40S and L4 have no NVLink: PCIe Gen4 x16, 64 -> 32.
Tensor parallelism's all-reduces and a prompt's K/V moving from a prefill worker to a decode
worker cross that link at 0.7 of it (NCCL's ring all-reduce reaches a bus bandwidth of about 70-80%
of NVLink's in nccl-tests at large messages), after a fixed 10 µs each (NCCL's small-message
latency within a node is of that order; an assumption). Workers on different nodes would cross
InfiniBand instead (400 Gb/s NDR = 50 GB/s a port): give ``--link-gbps 50``.

``cpu`` is this machine: the ceilings ``twophase calibrate`` measures (and caches), with
efficiencies fitted by ``twophase simulate --fit`` to the config's backend (cached one a backend
and weight format: torch, onnxruntime and native reach different shares of the same ceilings),
else defaults.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from twophase.errors import ConfigError
from twophase.paths import cache_dir
from twophase.plan.devices import GPUS

if TYPE_CHECKING:
    from twophase.config import Config

log = logging.getLogger(__name__)

TERA = 1e12
GIGA = 1e9
LINK_EFFICIENCY = 0.7


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str                   # "cpu" or "cuda": what the config's backends are put on
    peak_flops: float           # FLOP/s, 16-bit dense (CPU: float32 as calibrated)
    bandwidth: float            # bytes/s
    compute_efficiency: float   # share of peak_flops a step's matmuls reach
    bandwidth_efficiency: float  # share of bandwidth a step's weight and K/V reads reach
    step_overhead_s: float      # fixed host time a step beyond the roofline's bound
    source: str                 # where the figures come from
    link_bandwidth: float = 0.0  # bytes/s each way to a peer device (NVLink, PCIe; CPU: a copy);
                                 # 0: unknown, so no tensor parallelism or K/V handoff
    link_efficiency: float = LINK_EFFICIENCY
    link_latency_s: float = 10e-6  # fixed cost of one transfer or all-reduce
    # time beyond the roofline that grows with the step's work, fitted on the CPU (0 on GPUs:
    # not measured there): a sequence in the step, a byte of K/V its attention reads, a FLOP of
    # its attention (whose kernels reach less than the matmuls')
    seq_overhead_s: float = 0.0
    kv_byte_s: float = 0.0
    attention_flop_s: float = 0.0
    # the roofline bound's measured factor at a step of few tokens (the matmuls' rows), as
    # ``(tokens, factor)`` pairs in ascending order: a CPU GEMM's kernel is tiled for some row
    # counts (torch here: 2 or 3 rows cost more than 4 or 5). Linear between the pairs, 1 past
    # the last and where none is measured (GPUs).
    token_factors: tuple[tuple[int, float], ...] = ()

    def token_factor(self, tokens: int) -> float:
        f = self.token_factors
        if not f or tokens > f[-1][0]:
            return 1.0
        if tokens <= f[0][0]:
            return f[0][1]
        for (t0, f0), (t1, f1) in zip(f, f[1:]):
            if tokens <= t1:
                return f0 + (f1 - f0) * (tokens - t0) / (t1 - t0)
        return 1.0


# name: (peak FLOP/s, bytes/s)
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "h100-80gb": (989 * TERA, 3.35 * TERA),
    "h100-94gb": (835 * TERA, 3.9 * TERA),
    "h200": (989 * TERA, 4.8 * TERA),
    "a100-80gb": (312 * TERA, 2.039 * TERA),
    "a100-40gb": (312 * TERA, 1.555 * TERA),
    "l40s": (362 * TERA, 0.864 * TERA),
    "l4": (121 * TERA, 0.300 * TERA),
}
# name: bytes/s each way between two devices of a node
GPU_LINKS: dict[str, float] = {
    "h100-80gb": 450 * GIGA, "h100-94gb": 300 * GIGA, "h200": 450 * GIGA,
    "a100-80gb": 300 * GIGA, "a100-40gb": 300 * GIGA, "l40s": 32 * GIGA, "l4": 32 * GIGA,
}
GPU_COMPUTE_EFFICIENCY = 0.55
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_STEP_OVERHEAD_S = 1e-3

# the CPU's defaults before a fit: torch reaches most of the calibrated ceilings on large
# matmuls and streaming reads; the overhead is sampling a 49k-token vocabulary and the step's
# Python on this class of machine
CPU_COMPUTE_EFFICIENCY = 0.8
CPU_BANDWIDTH_EFFICIENCY = 0.8
CPU_STEP_OVERHEAD_S = 5e-3


def names() -> list[str]:
    return ["cpu", *GPU_PEAKS]


def device_spec(name: str, dtype: str = "float32", backend: str = "torch",
                quantization: str = "none") -> DeviceSpec:
    """The figures for ``name``: a GPU from the table, or ``cpu`` from this machine's calibration
    (measured now if none is cached: about 10 s) with ``backend``'s fit on ``quantization``
    weights."""
    key = name.lower()
    if key == "cpu":
        return cpu_spec(dtype, backend, quantization)
    if key not in GPU_PEAKS:
        raise ConfigError("--device", f"no figures for device {name!r}; known: {', '.join(names())}")
    assert key in GPUS, key               # the planner knows its memory
    peak, bw = GPU_PEAKS[key]
    if dtype == "float32":                # TF32 tensor cores: half the 16-bit rate
        peak /= 2
    return DeviceSpec(key, "cuda", peak, bw, GPU_COMPUTE_EFFICIENCY, GPU_BANDWIDTH_EFFICIENCY,
                      GPU_STEP_OVERHEAD_S, "NVIDIA datasheet peaks; typical published efficiencies",
                      link_bandwidth=GPU_LINKS[key])


def check_tp(tp: int, device: str) -> None:
    """Tensor parallelism is simulated over GPUs (their links are in the table), 1 or more."""
    if tp < 1 or (tp > 1 and device.lower() == "cpu"):
        raise ConfigError("--tp", f"tensor parallelism is simulated over GPUs, 1 or more; got {tp} on {device}")


def with_link(spec: DeviceSpec, gbps: float | None) -> DeviceSpec:
    """``spec`` with its link to peer devices at ``gbps`` GB/s each way (None: as it is)."""
    if gbps is None:
        return spec
    if gbps <= 0:
        raise ConfigError("--link-gbps", f"must be positive; got {gbps}")
    return replace(spec, link_bandwidth=gbps * GIGA, source=f"{spec.source}; link {gbps:g} GB/s given")


def fitted_backend(config: Config) -> str:
    """The backend a CPU fit of ``config`` is for: its own, or ``prefill+decode`` where the phases
    differ (``auto`` is simulated, so fitted, as torch)."""
    p, d = ("torch" if s.name == "auto" else s.name for s in config.phases())
    return p if p == d else f"{p}+{d}"


def fit_key(dtype: str, backend: str, quantization: str) -> str:
    """One fit a calibration (this CPU, dtype, threads), backend and weight format."""
    import torch

    from twophase.bench.calibrate import _key

    return f"{_key(torch.device('cpu'), getattr(torch, dtype))}|backend={backend}|quantization={quantization}"


def cpu_spec(dtype: str = "float32", backend: str = "torch", quantization: str = "none") -> DeviceSpec:
    """This machine's calibrated ceilings with ``backend``'s fitted efficiencies on
    ``quantization`` weights (the defaults where it has none)."""
    import torch

    from twophase.bench.calibrate import ceilings

    c = ceilings("cpu", getattr(torch, dtype))
    spec = DeviceSpec("cpu", "cpu", c.peak_flops, c.bandwidth, CPU_COMPUTE_EFFICIENCY,
                      CPU_BANDWIDTH_EFFICIENCY, CPU_STEP_OVERHEAD_S,
                      f"twophase calibrate ({c.measured_at}); default efficiencies",
                      # engines on one machine hand K/V over through shared memory: a copy at the
                      # calibrated bandwidth, after about a millisecond of Ray's object store
                      link_bandwidth=c.bandwidth, link_efficiency=0.5, link_latency_s=1e-3)
    key = fit_key(dtype, backend, quantization)
    fitted = _valid_fit(_read_fits().get(key), key)
    if fitted:
        spec = replace(spec, **{k: fitted[k] for k in FIT_FIELDS},
                       source=f"twophase calibrate ({c.measured_at}); efficiencies fitted "
                              f"{fitted.get('fitted_at', '')} on {fitted.get('model', '?')}, "
                              f"{backend}, {quantization} weights")
    return spec


def fits_path() -> Path:
    return cache_dir() / "simulate_fit.json"


def _read_fits() -> dict:
    try:
        data = json.loads(fits_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


FIT_FIELDS = ("compute_efficiency", "bandwidth_efficiency", "step_overhead_s", "seq_overhead_s", "kv_byte_s",
              "attention_flop_s", "token_factors")
REQUIRED_FIT_FIELDS = FIT_FIELDS[:3]      # older fits lack the rest: those default to 0 and none


def _valid_fit(entry: object, key: str) -> dict | None:
    """A cached fit's fields as numbers, or None (with a warning, so the defaults serve) where
    the file was edited or written by another version into something a spec cannot take."""
    if entry is None:
        return None
    try:
        if not isinstance(entry, dict):
            raise ValueError("not an object")
        out = dict(entry)
        for k in FIT_FIELDS[:-1]:
            if k not in entry and k not in REQUIRED_FIT_FIELDS:
                out[k] = 0.0
                continue
            v = entry[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{k} is {v!r}, not a number of 0 or more")
            out[k] = float(v)
        if out["compute_efficiency"] <= 0 or out["bandwidth_efficiency"] <= 0:
            raise ValueError("an efficiency of 0")
        pairs = entry.get("token_factors", [])
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in p) and p[0] >= 1 and p[1] > 0 for p in pairs):
            raise ValueError(f"token_factors is {pairs!r}, not [tokens, factor] pairs")
        out["token_factors"] = tuple(sorted((int(t), float(f)) for t, f in pairs))
        return out
    except (KeyError, ValueError) as e:
        missing = f"{e.args[0]} is missing" if isinstance(e, KeyError) else e
        log.warning("ignoring the cached simulation fit for %s in %s (%s); the defaults serve until "
                    "`twophase simulate --fit` refits it", key, fits_path(), missing)
        return None


def save_fit(spec: DeviceSpec, model: str, fitted_at: str, dtype: str = "float32", backend: str = "torch",
             quantization: str = "none") -> Path:
    """Keep fitted CPU efficiencies beside the calibration they were fitted over, apart from
    other backends' and weight formats'."""
    data = _read_fits()
    entry = {k: v for k, v in asdict(spec).items()
             if k in FIT_FIELDS}
    data[fit_key(dtype, backend, quantization)] = {**entry, "model": model, "fitted_at": fitted_at,
                                                   "backend": backend, "quantization": quantization}
    path = fits_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
