"""Fit the CPU's efficiencies and per-step overhead to the torch backend on this machine: a
short profiling sweep (prefill chunks, decodes at batch 1 to 32) run for real, and the same
requests simulated. With every request there at the start, the scheduler decides the same
steps on either clock, so step ``i`` of one is step ``i`` of the other; the fit chooses the
efficiencies and overhead whose step times come closest (least relative error) to the
measured time from one step's start to the next's."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from typing import Any

from twophase.bench.serving import TimedRequest
from twophase.config import Config
from twophase.simulate.cost import StepCostModel
from twophase.simulate.devices import DeviceSpec, cpu_spec, save_fit


def sweep(vocab: int) -> list[list[TimedRequest]]:
    """Workloads, each all at once: long prompts (prefill at the token budget), then decodes
    at batch 1, 8 and 32."""
    import random

    rng = random.Random(0)

    def reqs(n: int, prompt: int, out: int) -> list[TimedRequest]:
        return [TimedRequest(0.0, [rng.randrange(3, vocab) for _ in range(prompt)], out) for _ in range(n)]

    return [reqs(2, 256, 1), reqs(1, 64, 12), reqs(8, 32, 8), reqs(24, 16, 6)]


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


def fit_cpu(config: Config, console: Any = None) -> DeviceSpec:
    """Measure, fit, cache (``devices.save_fit``) and return the fitted CPU figures."""
    from twophase.llm import LLM
    from twophase.simulate import driver
    from twophase.simulate.engine import SimulatedLLM

    base = cpu_spec("float32")
    cfg = dataclasses.replace(config, backend=dataclasses.replace(config.backend, name="torch", device="cpu",
                                                                  prefill=None, decode=None))
    measured: list[float] = []
    chunks: list[list[tuple[tuple[int, int], ...]]] = []
    with LLM(cfg) as llm:
        model = llm.model.model_id
        for reqs in sweep(llm.model.arch.vocab_size):
            llm.engine = llm._build_engine()              # a fresh pool and prefix cache each
            driver.drive(llm.engine, [dataclasses.replace(r) for r in reqs], time.perf_counter, time.sleep)
            measured += step_walls(list(llm.engine.steps.records))
            sim = SimulatedLLM(cfg, base)
            sim.num_blocks = llm.num_blocks
            sim.engine = sim._build_engine(clock=sim.clock)
            driver.drive(sim.engine, reqs, sim.clock, sim.clock.sleep)
            calls = sim.backend.calls
            if len(calls) != len(llm.engine.steps.records):
                raise RuntimeError("the fit's real and simulated runs scheduled different steps")
            chunks += [[c.chunks] for c in calls]
    cost = StepCostModel(llm.model.arch, dataclasses.replace(base, compute_efficiency=1.0,
                                                             bandwidth_efficiency=1.0, step_overhead_s=0.0),
                         "float32", 4)
    parts = [(cost.step(c[0]).compute_s, cost.step(c[0]).memory_s) for c in chunks]
    best: tuple[float, float, float, float] | None = None
    grid = [i / 100 for i in range(2, 101)]
    for ec in grid:
        for eb in grid:
            bounds = [max(c / ec, m / eb) for c, m in parts]
            overhead = max(0.0, weighted_median([(t - b, 1 / t) for t, b in zip(measured, bounds)]))
            err = sum(abs(b + overhead - t) / t for b, t in zip(bounds, measured))
            if best is None or err < best[0]:
                best = (err, ec, eb, overhead)
    assert best is not None
    err, ec, eb, overhead = best
    spec = dataclasses.replace(base, compute_efficiency=ec, bandwidth_efficiency=eb, step_overhead_s=overhead)
    path = save_fit(spec, model, datetime.now().astimezone().isoformat(timespec="seconds"))
    if console is not None:
        console.print(f"fitted over {len(measured)} steps of {model}: compute efficiency {ec:.2f}, "
                      f"bandwidth efficiency {eb:.2f}, overhead {overhead * 1e3:.1f} ms a step "
                      f"(mean error {100 * err / len(measured):.0f}% a step); wrote {path}")
    return cpu_spec("float32")
