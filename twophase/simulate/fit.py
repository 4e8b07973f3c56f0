"""Fit the CPU's efficiencies and host overheads to the config's backend on this machine (one
fit a backend and weight format: each reaches its own share of the calibrated ceilings): a short
profiling sweep (prefill chunks, decodes at batch 1 to 24 and at long context, prompts joining
running decodes) run for real, and the same requests simulated. With requests fed by step, not
by clock, the scheduler decides the same steps on either clock, so step ``i`` of one is step
``i`` of the other; the fit chooses the
efficiencies (a grid), host terms (a step's, a sequence's, a K/V byte's, an attention FLOP's:
least squares) and then, for steps of few tokens, a factor on the roofline's bound a token
count (Vidur's profiling by batch size in its simplest form, measured where serving decodes)
whose step times come closest (least relative error) to the measured time from one step's start
to the next's (each step's median over a few passes, after one that warms the backend: one pass
is at the mercy of the machine's other work)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from twophase.bench.serving import TimedRequest
from twophase.config import Config
from twophase.simulate.devices import DeviceSpec, cpu_spec, fitted_backend, save_fit

SHORT_PROMPTS = (20, 32, 48, 64, 96, 128)   # prefilled alone, a step each (not 24: a decode batch)
JOINING = (64, 96, 128, 160, 192, 224, 256)  # prompts that join running decodes


def sweep(vocab: int) -> list[list[TimedRequest]]:
    """Workloads, each fed by step (``run_steps``: a request's ``offset_s`` is the step it joins
    before), shaped as serving's steps are:

    - prompts alone (prefill at the token budget and below), and one of each of SHORT_PROMPTS'
      lengths (served, such a prompt or tail is often a step's only chunk: its GEMM's rows are
      few, and a CPU GEMM is off its large-row efficiency there);
    - decodes at every batch from 1 to 8 after 192-token prompts, joined at two steps by a
      prompt of 64-256 tokens (a new prompt is prefilled beside the running decodes: that mixed
      step is most of its time to first token), and at 24 after short prompts, in about equal
      numbers of steps (serving decodes mostly at small batches and a few hundred tokens of
      context; a CPU GEMM's cost is not smooth in its rows there);
    - long prompts' chunks at depth and their decodes at 768 and 1280 tokens of context
      (attention's share, which long prompts reach);
    - prompts after a cached 512-token prefix joining its first request's decodes (a tail of a
      few dozen tokens at depth beside decodes: the cached K/V's gather)."""
    import random

    rng = random.Random(0)

    def reqs(n: int, prompt: int, out: int, at: int = 0) -> list[TimedRequest]:
        return [TimedRequest(at, [rng.randrange(3, vocab) for _ in range(prompt)], out) for _ in range(n)]

    def joined(b: int) -> list[TimedRequest]:
        first, second = JOINING[b % len(JOINING)], JOINING[(b + 3) % len(JOINING)]
        return reqs(b, 192, 20) + reqs(1, first, 2, at=5) + reqs(1, second, 2, at=13)

    system = [rng.randrange(3, vocab) for _ in range(512)]
    shared = [TimedRequest(at, system + [rng.randrange(3, vocab) for _ in range(rng.randint(32, 64))], out)
              for at, out in ((0, 20), (4, 4), (7, 4), (10, 4), (13, 4), (16, 4))]
    return [reqs(2, 256, 1), *(joined(b) for b in range(1, 9)), reqs(24, 16, 6), reqs(2, 768, 16),
            reqs(3, 1280, 16), shared, *(reqs(1, n, 1) for n in SHORT_PROMPTS)]


class StepClock:
    """The sweep's clock: the steps ``engine`` has taken (plus the waits of an idle one), so
    ``driver.drive`` feeds each request before the step its ``offset_s`` names, and a real
    engine and a simulated one take the same steps whatever each costs (a fresh engine a
    workload: its step log holds them all)."""

    def __init__(self, engine: Any):
        self.engine, self.waited = engine, 0.0

    def __call__(self) -> float:
        return self.engine.stats().num_steps + self.waited

    def sleep(self, steps: float) -> None:
        self.waited += steps


def run_steps(engine: Any, requests: list[TimedRequest]) -> None:
    """Serve ``requests`` on ``engine``, fed by step (``StepClock``), until all have finished."""
    from twophase.simulate import driver

    clock = StepClock(engine)
    driver.drive(engine, requests, clock, clock.sleep)


def step_walls(records: list[Any]) -> list[float]:
    """Each step's time to the next step's start (the last: its own duration)."""
    out = [b.start - a.start for a, b in zip(records, records[1:])]
    return out + [records[-1].duration] if records else out


# a step's compute and memory time, sequences, K/V bytes read, attention FLOPs, tokens
Part = tuple[float, float, float, float, float, int]


def measure(cfg: Config, base: DeviceSpec, passes: int = 3) -> tuple[str, list[float], list[Part]]:
    """The sweep on ``cfg``'s backends for real, after one pass that warms them (first-touch
    pages, kernels picked per shape): each step's median wall time over ``passes``, and its
    simulated compute and memory time at efficiency 1 (the simulation's own costing on ``base``:
    its weights' format and K/V bytes)."""
    from statistics import median

    from twophase.bench.run import Phases
    from twophase.llm import LLM
    from twophase.simulate.engine import SimulatedLLM

    runs: list[list[float]] = []
    parts: list[Part] = []
    with LLM(cfg) as llm:
        model = llm.model.model_id
        workloads = sweep(llm.model.arch.vocab_size)
        with Phases((passes + 1) * len(workloads), "fit") as progress:
            for i in range(passes + 1):
                progress.phase(f"sweep pass {i} of {passes}" if i else "sweep warm-up pass")
                walls = []
                for reqs in workloads:
                    llm.engine = llm.build_engine()               # a fresh pool and prefix cache each
                    run_steps(llm.engine, reqs)
                    walls += step_walls(llm.engine.step_records())
                    progress.advance()
                if i:
                    runs.append(walls)
        for reqs in workloads:
            sim = SimulatedLLM(cfg, base)
            sim.with_blocks(llm.num_blocks)
            run_steps(sim.engine, reqs)
            calls = sorted((c for b in sim.backends for c in b.calls), key=lambda c: c.start)
            cost = sim.prefill_backend.cost
            assert cost is not None
            parts += [(c.cost.compute_s * base.compute_efficiency, c.cost.memory_s * base.bandwidth_efficiency,
                       float(len(c.chunks)), cost.kv_read(c.chunks), cost.attention_flops(c.chunks),
                       sum(n for n, _ in c.chunks))
                      for c in calls]
    if any(len(w) != len(parts) for w in runs):
        raise RuntimeError("the fit's real and simulated runs scheduled different steps")
    return model, [median(ts) for ts in zip(*runs)], parts


Factors = tuple[tuple[int, float], ...]
Fit = tuple[float, float, float, float, float, float, float, Factors]

FACTOR_TOKENS = 128     # steps of 2 to this many tokens get a measured factor a token count
ROUNDS = 4              # factors and host terms refitted in turn, the efficiencies kept


def host_terms(measured: list[float], bounds: list[float], work: list[list[float]]) -> list[float]:
    """The time a step and a unit of each ``work`` column (sequences, K/V bytes, attention FLOPs
    a step) that least-squares fit what the roofline's ``bounds`` leave of each step's time,
    relative to it (weights 1 / t); a term that would come out negative is dropped."""
    import numpy as np

    t = np.asarray(measured)
    cols = [np.ones_like(t), *(np.asarray(w) for w in work)]
    keep = list(range(len(cols)))
    while True:
        a = np.stack([cols[i] / t for i in keep], axis=1)
        x = np.linalg.lstsq(a, (t - np.asarray(bounds)) / t, rcond=None)[0]
        if (x >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, v in zip(keep, x) if v >= 0] or [0]
    out = [0.0] * len(cols)
    for k, v in zip(keep, x):
        out[k] = max(0.0, float(v))
    return out


def token_factors(measured: list[float], parts: list[Part], ec: float, eb: float, host: list[float]) -> Factors:
    """Per token count from 2 to FACTOR_TOKENS: the median over its steps of what the fitted
    host terms leave of the measured time, over the roofline's bound (within 0.25 to 8). A
    decode at batch 1 has none: with one, its bound and the fixed overhead trade freely."""
    from statistics import median

    step, seq, byte, flop = host
    by: dict[int, list[float]] = {}
    for p, t in zip(parts, measured):
        if 2 <= p[5] <= FACTOR_TOKENS:
            rest = t - step - seq * p[2] - byte * p[3] - flop * p[4]
            by.setdefault(p[5], []).append(rest / max(p[0] / ec, p[1] / eb))
    return tuple((n, min(8.0, max(0.25, median(v)))) for n, v in sorted(by.items()))


def fit(measured: list[float], parts: list[Part]) -> Fit:
    """``(mean relative error, compute efficiency, bandwidth efficiency, time a step, a
    sequence, a K/V byte, an attention FLOP, token factors)``: the efficiencies (a grid) and host
    terms (least squares) of the least relative error over the steps no factor touches (a
    decode alone, and steps of more than FACTOR_TOKENS tokens: few-token prefills off the
    roofline's line would drag the compute efficiency down for every long prompt, by as much as
    their share of the sweep), then each small token count's factor on its steps' bounds (what
    the fit leaves of them) and the host terms over all the factored bounds, in turn, the
    efficiencies kept (fitted jointly, the factors and the bandwidth efficiency trade against
    the fixed overhead: decodes read the same weights at every batch). The error is the whole
    model's, over every step. Compute may pass 1: the calibrated peak is float32 matmuls', which
    int8 dot products (q4 blocks) exceed."""
    best: tuple[float, float, float, list[float]] | None = None
    plain = [(p, t) for p, t in zip(parts, measured) if p[5] == 1 or p[5] > FACTOR_TOKENS]
    plain_work = [[p[i] for p, _ in plain] for i in (2, 3, 4)]
    plain_t = [t for _, t in plain]
    for ec in [i / 50 for i in range(1, 151)]:
        for eb in [i / 50 for i in range(1, 51)]:
            bounds = [max(p[0] / ec, p[1] / eb) for p, _ in plain]
            host = host_terms(plain_t, bounds, plain_work)
            err = sum(abs(b + host[0] + sum(c * w[i] for c, w in zip(host[1:], plain_work)) - t) / t
                      for i, (b, t) in enumerate(zip(bounds, plain_t)))
            if best is None or err < best[0]:
                best = (err, ec, eb, host)
    assert best is not None
    _, ec, eb, host = best
    work = [[p[i] for p in parts] for i in (2, 3, 4)]
    factors: Factors = ()
    for _ in range(ROUNDS):          # the host terms again over the factored bounds, and so on
        factors = token_factors(measured, parts, ec, eb, host)
        scale = dict(factors)
        host = host_terms(measured, [max(p[0] / ec, p[1] / eb) * scale.get(p[5], 1.0) for p in parts], work)
    scale = dict(factors)
    err = sum(abs(max(p[0] / ec, p[1] / eb) * scale.get(p[5], 1.0) + host[0]
                  + sum(c * p[i] for c, i in zip(host[1:], (2, 3, 4))) - t) / t for p, t in zip(parts, measured))
    return (err / len(measured), ec, eb, host[0], host[1], host[2], host[3], factors)


def fit_cpu(config: Config, console: Any = None) -> DeviceSpec:
    """Measure ``config``'s own backend, fit, cache (``devices.save_fit``, under that backend and
    weight format) and return the fitted CPU figures."""
    from twophase.cli import flags
    from twophase.plan.budget import model_dtype
    from twophase.simulate.engine import for_device

    dtype = model_dtype(config, "cpu")
    backend, quantization = fitted_backend(config), config.model.quantization
    base = cpu_spec(dtype, backend, quantization)
    model, measured, parts = measure(flags.on_device(for_device(config, base), "cpu"), base)
    err, ec, eb, overhead, seq, byte, flop, factors = fit(measured, parts)
    spec = dataclasses.replace(base, compute_efficiency=ec, bandwidth_efficiency=eb, step_overhead_s=overhead,
                               seq_overhead_s=seq, kv_byte_s=byte, attention_flop_s=flop, token_factors=factors)
    path = save_fit(spec, model, datetime.now().astimezone().isoformat(timespec="seconds"), dtype,
                    backend, quantization)
    if console is not None:
        console.print(f"fitted over {len(measured)} steps of {model} on {backend} ({quantization} weights): "
                      f"compute efficiency {ec:.2f}, bandwidth efficiency {eb:.2f}, overhead "
                      f"{overhead * 1e3:.1f} ms a step + {seq * 1e3:.2f} ms a sequence + {byte * 1e9:.2f} "
                      f"ms a MB of K/V read + {flop * 1e12:.2f} s a TFLOP of attention; bound x "
                      f"{', '.join(f'{v:.2f}' for _, v in factors)} at {', '.join(str(n) for n, _ in factors)} tokens "
                      f"(mean error {100 * err:.0f}% a step); wrote {path}")
    return cpu_spec(dtype, backend, quantization)
