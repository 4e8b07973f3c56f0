"""scripts/gpu_check.sh and scripts/gpu_bench.py, checked here since a GPU machine is lent
rarely and briefly: arguments, the refusal of an environment that lacks what the checks need,
the summary it leaves, and gpu_bench's verdicts. The whole dry run is in the exhaustive lane."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def run(*args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    got = run("--help")
    assert got.returncode == 0 and "--dry-run" in got.stdout and "--budget-s" in got.stdout
    assert run("--bogus").returncode == 2
    bad = run("--budget-s", "ten")
    assert bad.returncode == 2 and "whole seconds" in bad.stderr
    assert "is not a folder" in run("--wheels", "/nonexistent").stderr


def test_an_environment_without_torch_is_refused_with_a_summary(tmp_path):
    """A Python that cannot import torch (here: isolated from every site-packages): the env
    stage says so, no other stage runs, and the summary lands in $OUT."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    got = run("--dry-run", env={"PYTHON": str(python), "OUT": str(out)})
    assert got.returncode == 2, got.stdout + got.stderr
    assert "torch does not import" in (out / "env.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit"] == 2 and [s["stage"] for s in summary["stages"]] == ["env"]
    assert summary["stages"][0]["status"] == "failed"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "scripts" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _output(tokens: list[int], logprobs: list[dict[int, float]]):
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_greedy_verdicts(bench):
    """Equal; split on a near-tie of the reference (passes); split past it, or log-probabilities
    off by more than bf16 allows, on the steps computed from one context (fails)."""
    ref = _output([1, 2, 3], [{1: -0.1, 9: -2.0}, {2: -0.5, 8: -0.55}, {3: -0.2, 7: -3.0}])
    same = bench.compare_greedy(_output([1, 2, 3], [{1: -0.12, 9: -2.0}, {2: -0.5, 8: -0.56},
                                                    {3: -0.2, 7: -3.0}]), ref)
    assert same["passed"] and same["verdict"] == "equal" and same["agree"] == 3
    tie = bench.compare_greedy(_output([1, 8, 5], [{1: -0.1, 9: -2.0}, {8: -0.5, 2: -0.52},
                                                   {5: -0.1, 6: -1.0}]), ref)
    assert tie["passed"] and tie["verdict"] == "near-tie" and tie["agree"] == 1
    assert abs(tie["gap_at_split"] - 0.05) < 1e-9
    split = bench.compare_greedy(_output([9, 2, 3], [{9: -0.1, 1: -0.3}, {2: -0.5}, {3: -0.2}]), ref)
    assert not split["passed"] and split["verdict"].startswith("DIVERGED")
    off = bench.compare_greedy(_output([1, 2, 3], [{1: -0.5, 9: -2.0}, {2: -0.5, 8: -0.55},
                                                   {3: -0.2, 7: -3.0}]), ref)
    assert not off["passed"] and off["verdict"] == "equal, LOGPROBS OFF"


@pytest.mark.exhaustive          # about a minute and a half on two cores
def test_the_whole_dry_run_passes(tmp_path):
    got = run("--dry-run", "--out", str(tmp_path), timeout=400)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [
        ("env", "passed"), ("greedy", "passed"), ("bench", "passed"), ("memory", "passed"), ("tests", "passed")]
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert {(c["phase"], c["graphs"]) for c in bench["cases"]} == {
        (p, g) for p in ("prefill", "decode") for g in (True, False)}
    assert all(c["valid"] for c in bench["cases"] if c["phase"] == "decode")
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert [c["pool"] for c in memory["cases"]] == ["fixed", "auto"]
