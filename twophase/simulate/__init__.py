"""``twophase simulate``: the engine's own scheduler and KV manager over simulated backends on a
virtual clock, each step costed by the roofline on a named device (docs/simulate.md)."""

from __future__ import annotations

from typing import Any

from twophase.bench.serving import TimedRequest
from twophase.config import Config
from twophase.simulate.devices import DeviceSpec
from twophase.simulate.report import SLO


def simulate(config: Config, device: DeviceSpec, requests: list[TimedRequest] | None = None,
             slo: SLO | None = None, acceptance: float = 0.7) -> dict[str, Any]:
    """Simulate ``config`` serving ``requests`` (default: its ``[bench.serving]`` workload) on
    ``device``: ``{"report": ..., "simulation": ...}`` (``report.simulation_report``);
    ``acceptance``: each drafted token's chance to be kept, where the config speculates."""
    from twophase.simulate import driver
    from twophase.simulate.engine import SimulatedLLM
    from twophase.simulate.report import simulation_report

    llm = SimulatedLLM(config, device, acceptance=acceptance)
    if requests is None:
        s = config.bench.serving
        requests = driver.workload(s.num_requests, s.rate, s.input_len, s.output_len,
                                   llm.model.arch.vocab_size, s.seed, s.jsonl)
    run = driver.drive(llm.engine, requests, llm.clock, llm.clock.sleep)
    return simulation_report(llm, run, slo or SLO())
