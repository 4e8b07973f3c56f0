"""Cheap configs for the simulator: named shapes, nothing downloaded, no weights."""

from __future__ import annotations

from twophase.config import Config, load_config
from twophase.simulate.devices import DeviceSpec

# a device of fixed figures, simulated on the "cpu" kind (no calibration is measured), its link
# to a peer 10 GB/s each way
TEST_DEVICE = DeviceSpec("test-cpu", "cpu", 2e11, 4e10, 0.8, 0.8, 2e-3, "tests", link_bandwidth=1e10,
                         link_efficiency=1.0, link_latency_s=1e-3)


def config(shape: str = "llama3-8b", **sections) -> Config:
    data = {"model": {"name": shape, "weights": "random"}, "backend": {"name": "torch"}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return load_config(data)
