"""``twophase simulate``: the engine's own scheduler and KV manager over simulated backends on a
virtual clock, each step costed by the roofline on a named device (docs/simulate.md)."""

from __future__ import annotations

from typing import Any

from twophase.bench.serving import TimedRequest
from twophase.config import Config
from twophase.simulate.devices import DeviceSpec
from twophase.simulate.report import SLO


def simulate(config: Config, device: DeviceSpec, requests: list[TimedRequest] | None = None,
             slo: SLO | None = None, acceptance: float = 0.7, tp: int = 1) -> dict[str, Any]:
    """Simulate ``config`` (one engine, or the replicas or prefill/decode workers its
    ``[cluster]`` asks for, each over ``tp`` devices) serving ``requests`` (default: its
    ``[bench.serving]`` workload) on ``device``: ``{"report": ..., "simulation": ...}``
    (``report.simulation_report``); ``acceptance``: each drafted token's chance to be kept,
    where the config speculates."""
    from twophase.simulate import driver, fleet
    from twophase.simulate.report import simulation_report

    f = fleet.Fleet(config, device, acceptance=acceptance, tp=tp)
    if requests is None:
        s = config.bench.serving
        requests = driver.workload(s.num_requests, s.rate, s.input_len, s.output_len,
                                   f.model.arch.vocab_size, s.seed, s.jsonl)
    return simulation_report(f, fleet.drive(f, requests), slo or SLO())
