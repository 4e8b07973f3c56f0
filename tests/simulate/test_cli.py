"""``twophase simulate`` end to end on a named shape: tables, JSON, plot, search."""

from __future__ import annotations

import json

from twophase.cli import main


def test_simulate_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "llama3-8b", "--device", "h200", "--requests", "12", "--rate", "20",
                 "--prompt-len", "100-300", "--output-len", "8", "--slo", "ttft=0.5,tpot=0.05",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["report"]["requests"] == 12 and data["report"]["output_tokens"] == 12 * 8
    assert data["simulation"]["device"]["name"] == "h200"
    assert data["simulation"]["goodput"]["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05}
    assert len(data["steps"]) == len(data["simulation"]["timeline"])
    assert "goodput" in capsys.readouterr().out


def test_search_ranks_settings_by_goodput(tmp_path, capsys):
    out = tmp_path / "search.json"
    assert main(["simulate", "llama3-8b", "--device", "h100-80gb", "--requests", "24", "--rate", "200",
                 "--prompt-len", "500", "--output-len", "20", "--slo", "ttft=0.3",
                 "--search", "scheduler.max_num_batched_tokens=512,8192",
                 "--search", "scheduler.max_num_seqs=4,32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["search"]
    assert len(rows) == 4
    goodput = [r["goodput_rps"] for r in rows]
    assert goodput == sorted(goodput, reverse=True) and goodput[0] > goodput[-1]
    assert rows[0]["settings"]["scheduler.max_num_seqs"] == 32
    assert "ranked by goodput" in capsys.readouterr().out


def test_the_plot_is_a_png(tmp_path):
    from helpers.simulated import TEST_DEVICE, config

    from twophase.bench.serving import synthetic
    from twophase.simulate import simulate
    from twophase.simulate.report import SLO, plot

    r = simulate(config("tiny"), TEST_DEVICE, synthetic(4, None, [8, 16], [4, 8], 512), SLO(ttft_s=1.0))
    assert plot(r, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
