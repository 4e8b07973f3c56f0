"""The bench's report, from a results dict alone: warnings when a figure deserves no trust,
tables that fit 80 columns, plots labelled in plain numbers; rounds and their outliers."""

from __future__ import annotations

import copy
import logging
import re

import pytest
from rich.console import Console

from twophase.bench import report, sweeps

QUIET = {"load_before": 0.1, "load_after": 1.9, "cores": 2, "seconds": 30.0, "steal_fraction": 0.0,
         "others_cpu_fraction": 0.02}


def measured(median_s: float, tokens: int, fraction: float, lo: float = 0.9, hi: float = 1.2) -> dict:
    return {"median_s": median_s, "min_s": median_s * lo, "max_s": median_s * hi, "rounds": 3,
            "tokens_per_s": tokens / median_s, "flops_per_s": 123.4e9, "bytes_per_s": 45.6e9,
            "roofline_fraction": fraction}


def latency(p50: float, p99: float) -> dict:
    return {"mean": p50, "p50": p50, "p90": p99, "p99": p99}


def served(n: int = 32) -> dict:
    return {"requests": n, "wall_s": 10.0, "request_throughput": 3.2, "output_tokens": 1234,
            "output_tokens_per_s": 123.4, "ttft_s": latency(0.0123, 0.4567), "tpot_s": latency(0.0234, 0.0456),
            "itl_s": latency(0.0211, 0.1234), "e2e_s": latency(1.2345, 12.3456),
            "ttft_values": [0.01, 0.012, 0.4567], "itl_values": [0.02, 0.021, 0.1234], "max_decode_batch": 12}


def results(**changes) -> dict:
    """A bench's results: quiet machine, current ceilings, every figure under its bound."""
    lines = ["torch", "onnxruntime", "hf"]
    res = {
        "command": "twophase bench examples/bench.toml", "model": "smollm2-135m-instruct",
        "device": "cpu", "dtype": "float32", "lines": lines, "repeats": 3, "repeats_requested": 3,
        "decode_context": 256, "cache_depth": 0,
        "ceilings": {"device": "AMD EPYC", "dtype": "float32", "peak_flops": 153e9, "bandwidth": 32e9,
                     "threads": 2, "peak_spread": 0.02, "bandwidth_spread": 0.03,
                     "measured_at": "2026-01-01T10:00:00+00:00", "machine": dict(QUIET)},
        "machine": dict(QUIET),
        "shapes": {"prefill": [128, 1024], "decode": [1, 32]},
        "prefill": {line: {"128": measured(0.0912, 128, 0.61), "1024": measured(1.234, 1024, 0.72)}
                    for line in lines},
        "decode": {line: {"1": measured(0.0123, 1, 0.55), "32": measured(0.0789, 32, 0.43)} for line in lines},
        "outliers": [], "notes": [], "baseline_missing": None,
        "serving": {"torch": served(), "onnxruntime": served(),
                    "hf": {"requests": 32, "wall_s": 20.0, "batch_size": 16, "request_throughput": 1.6,
                           "output_tokens": 1234, "output_tokens_per_s": 61.7}},
        "serving_workload": "32 requests, prompts 32–256 tokens, outputs 16–64, Poisson arrivals at 4 req/s",
        "roofline": {"prefill_intensity": 120.0, "prefill_intensity_at": 1024, "decode_intensity_b1": 0.98,
                     "decode_intensity": {"1": 0.98, "32": 20.1}, "decode_crossover_batch": 7,
                     "prefill_bound_tokens_per_s": {"128": 2000.0, "1024": 1200.0},
                     "decode_bound_tokens_per_s": {"1": 150.0, "32": 900.0}},
        "chunked": {mode: {**served(16), "itl_timeline": [0.02, 0.3 if mode == "off" else 0.05, 0.02],
                           "itl_timeline_at_s": [0.1, 0.4, 0.42], "long_prompt_arrival_s": 0.09,
                           "long_prompt_first_token_s": 0.39}
                    for mode in ("on", "off")},
        "chunked_long_prompt": 1024,
    }
    for key, value in changes.items():
        res[key] = value
    return res


def test_a_quiet_current_run_has_no_warnings():
    assert report.warnings(results()) == []


def test_a_figure_above_its_roofline_says_the_ceilings_are_stale():
    res = results()
    res["decode"]["onnxruntime"]["32"]["roofline_fraction"] = 1.6
    (w,) = report.warnings(res)
    assert "decode 32 on onnxruntime 160%" in w and "twophase calibrate --force" in w
    assert any(r[1] == "onnxruntime" and r[-1] == "160% !" for r in report.phase_rows(res, "decode"))


def test_a_calibration_under_load_or_without_records_is_named():
    res = results()
    res["ceilings"]["machine"] = {**QUIET, "load_before": 1.7}
    (w,) = report.warnings(res)
    assert "calibrated on a busy machine (1-minute load 1.70 on 2 cores" in w and "--force" in w
    old = {k: v for k, v in results()["ceilings"].items() if k in ("device", "dtype", "peak_flops",
                                                                     "bandwidth", "threads")}
    (w,) = report.warnings(results(ceilings=old))
    assert "no date or load record" in w and "--force" in w


def test_a_busy_bench_a_raised_repeat_count_an_outlier_and_a_missing_baseline_are_reported():
    res = results(machine={**QUIET, "others_cpu_fraction": 0.5}, repeats_requested=1,
                  baseline_missing='bench.baseline = "none"',
                  outliers=[{"phase": "decode", "shape": 4, "line": "torch", "round": 2, "seconds": 0.0318,
                             "median_s": 0.0014}])
    text = "\n".join(report.warnings(res))
    assert "not quiet during this bench (other processes used 50% of the CPU" in text
    assert "bench.repeats = 1 was raised to 3" in text
    assert "Round 2 of decode batch 4 on torch took 31.80 ms, 22.7x slower than the median" in text
    assert 'No HF baseline: bench.baseline = "none"' in text


def test_tables_fit_80_columns_whole():
    res = results()
    res["serving"]["torch, speculative ngram k=auto"] = served()
    console = Console(width=80, record=True, color_system=None)
    report.print_tables(res, console)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    assert "…" not in text
    for figure in ("1,404", "1,170–1,559", "x1.00", "12.3 / 456.7", "1234.5 / 12345.6"):
        assert figure in text, figure                 # medians and their min–max, never cut
    assert "left out at this width" in text          # what went to make room is said


def test_every_median_comes_with_its_min_max():
    row = report.phase_rows(results(), "prefill")[0]
    assert row[:4] == ["128", "torch", "1,404", "1,170–1,559"]


@pytest.mark.parametrize("values, flagged", [
    ([1.0, 1.1, 0.9], []),
    ([1.0, 1.1, 3.0], [2]),
    ([1.0, 0.4, 1.1, 1.05], [1]),
    ([1.0, 50.0], []),                                # two rounds have no median to judge by
])
def test_a_round_more_than_twice_off_its_median_is_flagged(values, flagged):
    assert [i for i, _, _ in sweeps.outliers(values)] == flagged


def test_fewer_than_three_repeats_are_raised_with_a_warning(caplog):
    from twophase.bench.run import _enough_rounds
    from twophase.config import BenchConfig

    with caplog.at_level(logging.WARNING):
        assert _enough_rounds(BenchConfig(repeats=1)).repeats == 3
    assert "bench.repeats = 1 raised to 3" in caplog.text
    assert _enough_rounds(BenchConfig(repeats=5)).repeats == 5


def test_each_case_has_an_untimed_warm_up_round_before_the_timed_ones():
    from twophase.bench.run import Phases, _sweeps
    from twophase.config import BenchConfig

    calls = []

    class Line:
        def prefill_round(self, n, depth, k):
            calls.append(("prefill", n, k))
            return 10.0 if k < 0 else 1.0 + k

        def decode_round(self, batch, context, steps, k):
            calls.append(("decode", batch, k))
            return 10.0 if k < 0 else 2.0 + k

    b = BenchConfig(repeats=3)
    times = _sweeps({"hf": Line()}, [("prefill", 16), ("decode", 4)], b, Phases(8))
    assert calls[:2] == [("prefill", 16, -1), ("decode", 4, -1)]
    assert calls[2:] == [(ph, x, k) for k in range(3) for ph, x in (("prefill", 16), ("decode", 4))]
    assert times["prefill"]["hf"][16] == [1.0, 2.0, 3.0] and times["decode"]["hf"][4] == [2.0, 3.0, 4.0]


def test_progress_off_a_terminal_is_one_log_line_a_phase(caplog, monkeypatch):
    from twophase.bench import run

    monkeypatch.setattr(run.sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level(logging.INFO, logger="twophase.bench.run"), run.Phases(4) as progress:
        progress.phase("round 1/3: 2 cases on torch")
        progress.item("round 1/3: prefill 128 on torch")
        progress.advance()
        progress.phase("serving workload on torch")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "round 1/3: 2 cases" in logged[0] and "serving" in logged[1]


def test_plot_ticks_are_plain_numbers(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from twophase.bench import plots

    fig, ax = plt.subplots()
    ax.plot([128, 256, 2048], [400, 900, 40000])
    plots._log_axis(ax, "x", [128, 256, 2048], fixed=[128, 256, 2048])
    plots._log_axis(ax, "y", [400, 900, 40000])
    fig.canvas.draw()
    xs = [t.get_text() for t in ax.get_xticklabels()]
    ys = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert xs == ["128", "256", "2,048"]
    assert ys[0] == "200" and "1,000" in ys and ys[-1] == "50,000"
    assert all(re.fullmatch(r"[\d,.]+", t) for t in xs + ys), xs + ys
    assert plots.plain(400) == "400" and plots.plain(0.5) == "0.5" and plots.plain(12000) == "12,000"


def test_every_plot_is_drawn_from_results_alone_with_its_notes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from twophase.bench import plots

    notes: list[str] = []
    real, save = plots._notes, plots._save
    monkeypatch.setattr(plots, "_notes", lambda fig, n: notes.extend(t for t, _ in n) or real(fig, n))
    tops = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path, n: tops.setdefault(path.name, [
        ax.get_ylim()[1] for ax in fig.axes]) and save(fig, path, n))
    res = results(baseline_missing='bench.baseline = "none"', lines=["torch", "onnxruntime"])
    res["prefill"]["torch"]["1024"]["roofline_fraction"] = 1.3
    files = report.plot(copy.deepcopy(res), tmp_path)
    assert [p.rsplit("/", 1)[1] for p in files] == ["prefill_tokens_per_s.png", "decode_tokens_per_s.png",
                                                      "ttft_itl.png", "chunked_itl.png"]
    assert all((tmp_path / p).stat().st_size > 1000 for p in files)
    stale = [n for n in notes if "twophase calibrate --force" in n]
    assert len(stale) == 1                            # on the prefill plot only
    assert sum("no HF baseline: bench.baseline" in n for n in notes) == 4
    assert any(n.startswith("hf: throughput only") for n in notes)
    assert min(tops["chunked_itl.png"]) >= 300          # the 0.3 s spike whole on both panels


def test_results_saved_by_an_older_bench_still_render(tmp_path):
    pytest.importorskip("matplotlib")
    res = results()
    for key in ("machine", "outliers", "repeats_requested", "baseline_missing"):
        del res[key]
    res["ceilings"] = {k: res["ceilings"][k] for k in ("device", "dtype", "peak_flops", "bandwidth", "threads")}
    for s in res["chunked"].values():
        for key in ("itl_timeline_at_s", "long_prompt_arrival_s", "long_prompt_first_token_s"):
            del s[key]
    files = report.write_all(res, tmp_path)
    assert len(files) == 6
    assert "no date or load record" in (tmp_path / "report.md").read_text()


def test_a_prefill_on_another_engine_names_its_ceiling():
    """Native prefill on bf16 tiles beside int8 decode dots: the headline names both engines and
    the prefill peak its roofline took; one engine for both says nothing more."""
    res = results()
    assert not any("prefill's in" in line for line in report.headline(res))
    res["ceilings"] = {**res["ceilings"], "dtype": "int8"}
    res["prefill_ceilings"] = {**res["ceilings"], "dtype": "bfloat16", "peak_flops": 1.5e12}
    said = [line for line in report.headline(res) if "prefill's in" in line]
    assert said and "int8" in said[0] and "bfloat16" in said[0] and "1.5 TFLOP/s" in said[0], said
