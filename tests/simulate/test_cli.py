"""``twophase simulate`` end to end on a named shape: tables, JSON, plot, search."""

from __future__ import annotations

import json

import pytest

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
                 "--search", "scheduler.max_num_seqs=4,32", "--json", str(out),
                 "--plot", str(tmp_path / "best.png")]) == 0
    rows = json.loads(out.read_text())["search"]
    assert len(rows) == 4
    assert (tmp_path / "best.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the best-ranked one's
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


def test_simulate_a_disaggregated_config_and_rank_deployments_per_device(tmp_path, capsys):
    cfg = tmp_path / "pd.toml"
    cfg.write_text('[model]\nname = "llama3-8b"\nweights = "random"\n\n'
                   '[cluster]\nprefill_workers = 1\ndecode_workers = 2\n')
    out = tmp_path / "pd.json"
    assert main(["simulate", str(cfg), "--device", "h100-80gb", "--requests", "16", "--rate", "20",
                 "--prompt-len", "300", "--output-len", "16", "--tp", "2", "--json", str(out)]) == 0
    sim = json.loads(out.read_text())["simulation"]
    assert sim["devices"] == 6 and [e["role"] for e in sim["engines"]] == ["prefill", "decode", "decode"]
    assert sim["kv_transfers"]["pulls"] == 16
    assert main(["simulate", "llama3-8b", "--device", "h100-80gb", "--requests", "24", "--rate", "4",
                 "--prompt-len", "200", "--output-len", "16", "--slo", "ttft=1",
                 "--search", "cluster.replicas=1,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["search"]
    # a load one GPU serves: the second replica doubles the devices, not the goodput
    assert [r["settings"]["cluster.replicas"] for r in rows] == [1, 2]
    assert [r["devices"] for r in rows] == [1, 2]
    assert rows[1]["goodput_per_device_rps"] == pytest.approx(rows[0]["goodput_per_device_rps"] / 2, rel=0.1)
    assert "per device" in capsys.readouterr().out


def test_tensor_parallelism_on_the_cpu_is_refused_by_name(capsys):
    assert main(["simulate", "tiny", "--device", "cpu", "--tp", "2", "--requests", "2"]) != 0
    err = capsys.readouterr()
    assert "--tp" in err.out + err.err and "Traceback" not in err.out + err.err
