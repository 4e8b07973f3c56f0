"""Fit the CPU's efficiencies and per-step overhead to the config's backend on this machine (one
fit a backend and weight format: each reaches its own share of the calibrated ceilings): a short
profiling sweep (prefill chunks, decodes at batch 1 to 24 and at long context) run for real, and
the same requests simulated. With every request there at the start, the scheduler decides the
same steps on either clock, so step ``i`` of one is step ``i`` of the other; the fit chooses the
efficiencies and overhead whose step times come closest (least relative error) to the measured
time from one step's start to the next's (each step's median over a few passes, after one that
warms the backend: one pass is at the mercy of the machine's other work)."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from typing import Any

from twophase.bench.serving import TimedRequest
from twophase.config import Config
from twophase.simulate.devices import DeviceSpec, cpu_spec, fitted_backend, save_fit


def sweep(vocab: int) -> list[list[TimedRequest]]:
    """Workloads, each all at once: prompts (prefill at the token budget and below), decodes at
    batch 1, 4, 8 and 24 in about equal numbers of steps (serving decodes mostly at small
    batches beyond one), and long prompts' chunks at depth with their decodes at 768 tokens of
    context (attention's share, which long prompts and shared prefixes reach)."""
    import random

    rng = random.Random(0)

    def reqs(n: int, prompt: int, out: int) -> list[TimedRequest]:
        return [TimedRequest(0.0, [rng.randrange(3, vocab) for _ in range(prompt)], out) for _ in range(n)]

    return [reqs(2, 256, 1), reqs(1, 64, 8), reqs(4, 64, 8), reqs(8, 32, 8), reqs(24, 16, 6), reqs(2, 768, 8)]


def step_walls(records: list[Any]) -> list[float]:
    """Each step's time to the next step's start (the last: its own duration)."""
    out = [b.start - a.start for a, b in zip(records, records[1:])]
    return out + [records[-1].duration] if records else out


def weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The value minimising the weighted sum of absolute deviations: (value, weight) pairs."""
    pairs = sorted(pairs)
    half, run = sum(w for _, w in pairs) / 2, 0.0
    for v, w in pairs:
        run += w
        if run >= half:
            return v
    return pairs[-1][0]


def measure(cfg: Config, base: DeviceSpec, passes: int = 3) -> tuple[str, list[float], list[tuple[float, float]]]:
    """The sweep on ``cfg``'s backends for real, after one pass that warms them (first-touch
    pages, kernels picked per shape): each step's median wall time over ``passes``, and its
    simulated compute and memory time at efficiency 1 (the simulation's own costing on ``base``:
    its weights' format and K/V bytes)."""
    from statistics import median

    from twophase.llm import LLM
    from twophase.simulate import driver
    from twophase.simulate.engine import SimulatedLLM

    runs: list[list[float]] = []
    parts: list[tuple[float, float]] = []
    with LLM(cfg) as llm:
        model = llm.model.model_id
        workloads = sweep(llm.model.arch.vocab_size)
        for i in range(passes + 1):
            walls = []
            for reqs in workloads:
                llm.engine = llm._build_engine()              # a fresh pool and prefix cache each
                driver.drive(llm.engine, [dataclasses.replace(r) for r in reqs], time.perf_counter, time.sleep)
                walls += step_walls(list(llm.engine.steps.records))
            if i:
                runs.append(walls)
        for reqs in workloads:
            sim = SimulatedLLM(cfg, base)
            sim.num_blocks = llm.num_blocks
            sim.engine = sim._build_engine(clock=sim.clock)
            driver.drive(sim.engine, reqs, sim.clock, sim.clock.sleep)
            calls = sorted((c for b in sim.backends for c in b.calls), key=lambda c: c.start)
            parts += [(c.cost.compute_s * base.compute_efficiency, c.cost.memory_s * base.bandwidth_efficiency)
                      for c in calls]
    if any(len(w) != len(parts) for w in runs):
        raise RuntimeError("the fit's real and simulated runs scheduled different steps")
    return model, [median(ts) for ts in zip(*runs)], parts


def fit(measured: list[float], parts: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """``(mean relative error, compute efficiency, bandwidth efficiency, overhead)`` of the
    least relative error over the steps. Compute may pass 1: the calibrated peak is float32
    matmuls', which int8 dot products (q4 blocks) exceed."""
    best: tuple[float, float, float, float] | None = None
    for ec in [i / 100 for i in range(2, 301)]:
        for eb in [i / 100 for i in range(2, 101)]:
            bounds = [max(c / ec, m / eb) for c, m in parts]
            overhead = max(0.0, weighted_median([(t - b, 1 / t) for t, b in zip(measured, bounds)]))
            err = sum(abs(b + overhead - t) / t for b, t in zip(bounds, measured))
            if best is None or err < best[0]:
                best = (err, ec, eb, overhead)
    assert best is not None
    err, ec, eb, overhead = best
    return err / len(measured), ec, eb, overhead


def fit_cpu(config: Config, console: Any = None) -> DeviceSpec:
    """Measure ``config``'s own backend, fit, cache (``devices.save_fit``, under that backend and
    weight format) and return the fitted CPU figures."""
    from twophase import flags
    from twophase.plan.budget import model_dtype
    from twophase.simulate.engine import for_device

    dtype = model_dtype(config, "cpu")
    backend, quantization = fitted_backend(config), config.model.quantization
    base = cpu_spec(dtype, backend, quantization)
    model, measured, parts = measure(flags.on_device(for_device(config, base), "cpu"), base)
    err, ec, eb, overhead = fit(measured, parts)
    spec = dataclasses.replace(base, compute_efficiency=ec, bandwidth_efficiency=eb, step_overhead_s=overhead)
    path = save_fit(spec, model, datetime.now().astimezone().isoformat(timespec="seconds"), dtype,
                    backend, quantization)
    if console is not None:
        console.print(f"fitted over {len(measured)} steps of {model} on {backend} ({quantization} weights): "
                      f"compute efficiency {ec:.2f}, bandwidth efficiency {eb:.2f}, overhead "
                      f"{overhead * 1e3:.1f} ms a step (mean error {100 * err:.0f}% a step); wrote {path}")
    return cpu_spec(dtype, backend, quantization)
