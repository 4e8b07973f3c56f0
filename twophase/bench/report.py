"""The bench's outputs: terminal tables (rich), ``results.json``, ``report.md`` and PNG plots.
Everything is drawn from the results dict alone, so a saved ``results.json`` can be re-rendered.

Tables fit 80 columns (long line names wrap, figures never do); every median comes with its
min–max over rounds; warnings say when a figure should not be trusted: measured above its
roofline bound (the ceilings are stale), a calibration or a bench on a busy machine, a round far
off its case's others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from twophase.bench.results import above_roofline, tokens_range
from twophase.cli.terminal import console as terminal_console
from twophase.cli.terminal import styled
from twophase.errors import install_hint
from twophase.measure import machine

RECALIBRATE = "run `twophase calibrate --force` on a quiet machine, then bench again"


def _num(v: float | None) -> str:
    """A plain number, digits grouped, one decimal below 100."""
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _si(v: float | None) -> str:
    """``v`` with an SI prefix, for FLOP/s and bytes/s columns (the unit is in the header)."""
    if v is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.1f} {prefix}"
    return f"{v:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def phase_columns(res: dict[str, Any], phase: str) -> list[str]:
    return ["prompt" if phase == "prefill" else "batch", "line", "tok/s", "min–max",
            f"vs {res['lines'][0]}", "FLOP/s", "B/s", "of roofline"]


def phase_rows(res: dict[str, Any], phase: str) -> list[list[str]]:
    """One row per (shape, line): median tokens/s and its min–max over rounds, the ratio to
    the first line, achieved FLOP/s and bytes/s, and the fraction of the roofline bound."""
    rows = []
    lines = res["lines"]
    for key in res["shapes"][phase]:
        base = res[phase][lines[0]].get(str(key), {}).get("tokens_per_s")
        for line in lines:
            m = res[phase][line].get(str(key))
            if m is None:
                continue
            lo, hi = tokens_range(m, float(key))   # a prompt's tokens, or one a sequence
            frac = m["roofline_fraction"]
            rows.append([str(key), line, _num(m["tokens_per_s"]), f"{_num(lo)}–{_num(hi)}",
                         f"x{m['tokens_per_s'] / base:.2f}" if base else "-",
                         _si(m["flops_per_s"]), _si(m["bytes_per_s"]),
                         f"{100 * frac:.0f}%" + (" !" if frac > 1 else "")])
    return rows


THROUGHPUT_COLUMNS = ["line", "req/s", "output tok/s", "max decode batch"]
LATENCY_COLUMNS = ["line", "TTFT", "TPOT", "ITL", "E2E"]


def _serving_lines(res: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, summary, note) for each serving run: the workload's, then the chunked pair."""
    out = []
    for line, s in res["serving"].items():
        note = str(s.get("max_decode_batch", "-"))
        if "ttft_s" not in s:
            note = f"static batches of {s['batch_size']}"
        out.append((line, s, note))
    for mode, s in res.get("chunked", {}).items():
        out.append((f"{res['lines'][0]}, chunked prefill {mode}", s,
                    f"ITL max {_ms(max(s['itl_values'], default=0))} ms"))
    return out


def throughput_rows(res: dict[str, Any]) -> list[list[str]]:
    return [[label, f"{s['request_throughput']:.2f}", _num(s["output_tokens_per_s"]), note]
            for label, s, note in _serving_lines(res)]


def latency_rows(res: dict[str, Any]) -> list[list[str]]:
    """p50 / p99 in ms; the HF reference has none (static batches give no per-token times)."""
    keys = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
    return [[label, *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p99'])}" if k in s else "-" for k in keys)]
            for label, s, _ in _serving_lines(res)]


def _calibration_note(c: dict[str, Any]) -> str:
    when = c.get("measured_at") or "at an unknown date"
    spread = max(c.get("peak_spread", 0.0), c.get("bandwidth_spread", 0.0))
    return f"calibrated {when}, best runs within {100 * spread:.0f}%" if "peak_spread" in c else \
        f"calibrated {when}"


def _prefill_engine(res: dict[str, Any]) -> list[str]:
    """A sentence where prefill's matmuls ran on another engine than decode's (bf16 tiles
    beside int8 dots, say), whose ceiling its roofline takes."""
    p, c = res.get("prefill_ceilings"), res["ceilings"]
    if not p or p.get("dtype") == c.get("dtype"):
        return []
    return [f"Decode's matmuls ran in {c['dtype']}, prefill's in {p['dtype']}: prefill's roofline takes "
            f"that engine's {_si(p['peak_flops'])}{'OP' if p['dtype'] == 'int8' else 'FLOP'}/s peak "
            f"({_calibration_note(p)})."]


def headline(res: dict[str, Any]) -> list[str]:
    c, rf = res["ceilings"], res["roofline"]
    cross = rf["decode_crossover_batch"]
    sp = rf.get("speculative")
    spec = [] if not sp else [
        f"With speculation ({sp['line']}): a verify pass computed {sp['tokens_computed_per_pass']:.2f} "
        f"tokens a sequence for one read of the weights, raising decode's intensity at batch 1 from "
        f"{sp['decode_intensity_b1']:.2f} to {sp['verify_intensity_b1']:.2f} FLOP/byte; "
        f"{sp['mean_accepted_length']:.2f} of them were kept ({sp['kept_intensity_b1']:.2f} FLOP/byte "
        f"of work that became output)."]
    return [
        f"{res['model']} on {res['device']} ({res['dtype']}); ceilings measured by `twophase "
        f"calibrate`: {_si(c['peak_flops'])}FLOP/s matmul peak, {_si(c['bandwidth'])}B/s "
        f"memory bandwidth (ridge {c['peak_flops'] / c['bandwidth']:.1f} FLOP/byte; "
        f"{_calibration_note(c)}).",
        *_prefill_engine(res),
        f"Arithmetic intensity: prefill {rf['prefill_intensity']:.0f} FLOP/byte at "
        f"{rf['prefill_intensity_at']} tokens, decode {rf['decode_intensity_b1']:.2f} at batch 1 "
        f"(context {res['decode_context']}); decode turns compute-bound at batch "
        f"{cross if cross else 'never (the K/V read grows with the batch)'}.",
        *spec,
        *res.get("notes", res.get("skipped", [])),      # "skipped": results of older benches
    ]


def _roofline_warnings(res: dict[str, Any]) -> list[str]:
    out = []
    above = above_roofline(res)
    if above:
        which = ", ".join(f"{p} {k} on {line} {100 * f:.0f}%" for p, k, line, f in above)
        out.append(f"Measured above the roofline bound ({which}): no figure can beat its bound, so "
                   f"the ceilings are probably stale or were measured on a busy machine; {RECALIBRATE}.")
    c = res["ceilings"]
    if "measured_at" not in c:
        out.append(f"The ceilings carry no date or load record (an older calibration); {RECALIBRATE}.")
    busy = machine.busy_reasons(c.get("machine"))
    if busy:
        out.append(f"The ceilings were calibrated on a busy machine ({'; '.join(busy)}), so the "
                   f"roofline may sit too low; {RECALIBRATE}.")
    return out


def _round_warnings(res: dict[str, Any], limit: int = 8) -> list[str]:
    out = []
    asked = res.get("repeats_requested", res["repeats"])
    if asked < res["repeats"]:
        out.append(f"bench.repeats = {asked} was raised to {res['repeats']}: a median and its "
                   f"spread need {res['repeats']} rounds at least.")
    odd = res.get("outliers", [])
    for o in odd[:limit]:
        what = "prompt" if o["phase"] == "prefill" else "batch"
        r = o["seconds"] / o["median_s"]
        how = f"{r:.1f}x slower" if r > 1 else f"{1 / r:.1f}x faster"
        out.append(f"Round {o['round']} of {o['phase']} {what} {o['shape']} on {o['line']} took "
                   f"{o['seconds'] * 1e3:.2f} ms, {how} than the median of its rounds "
                   f"({o['median_s'] * 1e3:.2f} ms): something else ran then.")
    if len(odd) > limit:
        out.append(f"... and {len(odd) - limit} more rounds that far off (results.json: outliers).")
    return out


def warnings(res: dict[str, Any]) -> list[str]:
    """Why some figures of this run deserve less trust than the tables suggest."""
    out = _roofline_warnings(res)
    busy = machine.busy_reasons(res.get("machine"))
    if busy:
        out.append(f"The machine was not quiet during this bench ({'; '.join(busy)}): figures are "
                   f"slower and noisier than the device allows; bench again when it is quiet.")
    out += _round_warnings(res)
    if res.get("baseline_missing"):
        out.append(f"No HF baseline: {res['baseline_missing']}.")
    return out


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    """A compact table: text columns may wrap (not below ``TEXT_MIN``), figures never do (nor
    turn into '…')."""
    t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for i, col in enumerate(columns):
        text = _is_text(i, col)
        longest = max([len(r[i]) for r in rows] + [len(col)])
        t.add_column(col, justify="left" if text else "right", overflow="fold", no_wrap=not text,
                     min_width=min(longest, TEXT_MIN) if text else longest)
    for row in rows:
        t.add_row(*row)
    return t


def tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) of every table, terminal and markdown alike."""
    rounds = f"median and min–max of {res['repeats']} rounds after a warm-up"
    return [
        (f"prefill: prompt tokens/s, {rounds}", phase_columns(res, "prefill"), phase_rows(res, "prefill")),
        (f"decode: tokens/s at context {res['decode_context']}, {rounds}", phase_columns(res, "decode"),
         phase_rows(res, "decode")),
        (f"serving throughput: {res['serving_workload']}", THROUGHPUT_COLUMNS, throughput_rows(res)),
        ("serving latency: p50 / p99 in ms", LATENCY_COLUMNS, latency_rows(res)),
    ]


DROPPABLE = ("B/s", "FLOP/s")          # left out, in this order, from a terminal too narrow
TEXT_MIN = 12                          # a text column may wrap down to this width


def _is_text(i: int, col: str) -> bool:
    return i == 0 or col == "line"


def _width(columns: list[str], rows: list[list[str]]) -> int:
    """Characters ``_table`` needs: figures and their headers whole, text wrapped to
    ``TEXT_MIN``, three between columns (a separator and its padding)."""
    total = 3 * (len(columns) - 1)
    for i, col in enumerate(columns):
        w = max([len(r[i]) for r in rows] + [len(col)])
        total += min(w, max(TEXT_MIN, *map(len, col.split()))) if _is_text(i, col) else w
    return total


def fit(columns: list[str], rows: list[list[str]], width: int) -> tuple[list[str], list[list[str]], list[str]]:
    """The table with ``DROPPABLE`` columns left out until it fits ``width``; and which went."""
    dropped = []
    for name in DROPPABLE:
        if _width(columns, rows) <= width or name not in columns:
            continue
        i = columns.index(name)
        columns = columns[:i] + columns[i + 1:]
        rows = [r[:i] + r[i + 1:] for r in rows]
        dropped.append(name)
    return columns, rows, dropped


def print_tables(res: dict[str, Any], console: Console | None = None) -> None:
    console = console or terminal_console()
    for text in headline(res):
        console.print(text, highlight=False)
    for text in warnings(res):
        console.print(styled(("warning:", "bold yellow"), " ", text))
    for title, columns, rows in tables(res):
        columns, rows, dropped = fit(columns, rows, console.width)
        console.print(_table(title, columns, rows))
        if dropped:
            console.print(f"({' and '.join(dropped)} left out at this width: see report.md)", highlight=False)


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(res: dict[str, Any], path: Path, plots: list[str]) -> None:
    parts = ["# twophase bench", "", *headline(res), "", f"Command: `{res['command']}`", ""]
    warn = warnings(res)
    if warn:
        parts += ["## Warnings", "", *(f"- {w}" for w in warn), ""]
    for title, columns, rows in tables(res):
        parts += [f"## {title[0].upper()}{title[1:]}", "", _md_table(columns, rows), ""]
    parts += ["Ratios are to the first line, measured in the same run; 'of roofline' is the "
              "analytic lower bound on the step's time over the measured median time (above 100%: "
              "the ceilings are wrong, see the warnings).", ""]
    parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    path.write_text("\n".join(parts) + "\n")


def plot(res: dict[str, Any], out: Path) -> list[str]:
    """PNG plots; returns their paths (none, with a warning, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        import logging

        logging.getLogger(__name__).warning("no plots: matplotlib is not installed "
                                            f"({install_hint('bench')})")
        return []

    matplotlib.use("Agg")
    from twophase.bench import plots

    files = [plots.phase(res, phase, out) for phase in ("prefill", "decode")]
    files.append(plots.latency(res, out))
    if res.get("chunked"):
        files.append(plots.chunked(res, out))
    return files


def write_all(res: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    files = plot(res, out)
    write_markdown(res, out / "report.md", files)
    return [out / "results.json", out / "report.md", *map(Path, files)]
