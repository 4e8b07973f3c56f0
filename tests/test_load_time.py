"""What a load spends its time on: each stage is recorded and a slow load names them; building
the model on the meta device imports nothing heavy (its default initialisation once imported
``torch._dynamo``, 3-11 s of a load on a Zen 3 core)."""

from __future__ import annotations

import subprocess
import sys

from helpers.models import tiny_llm

from twophase.builder.stage_times import SLOW_LOAD_S, load_line


def test_a_load_records_its_stages_and_a_slow_one_names_them():
    llm = tiny_llm()
    stages = llm.load_breakdown_s
    assert {"model files", "memory plan", "backend load", "KV pool and bind", "engine"} <= set(stages)
    assert sum(stages.values()) <= llm.load_time_s + 1e-6
    assert llm.report()["load_breakdown_s"] == stages
    assert load_line({"load_time_s": 0.5, "load_breakdown_s": {"backend load": 0.4}}) == "0.50 s"
    slow = load_line({"load_time_s": SLOW_LOAD_S + 10,
                      "load_breakdown_s": {"model files": 1.0, "memory plan": 10.5, "engine": 0.001}})
    assert slow == "12.00 s (memory plan 10.50 s, model files 1.00 s)"


def test_building_a_model_does_not_import_torch_dynamo():
    code = ("import sys\nfrom twophase import LLM\n"
            "LLM.from_config({'model': {'name': 'tiny', 'weights': 'random'}, 'cache': {'num_blocks': 8}})\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
