"""One local Ray cluster for every test here (starting one takes seconds)."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")


@pytest.fixture(scope="session")
def ray_cluster():
    env = {k: v for k, v in os.environ.items() if k.startswith("TWOPHASE_")}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**env, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()
