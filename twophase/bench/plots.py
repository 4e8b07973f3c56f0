"""The bench's plots, drawn from the results dict alone (matplotlib, Agg backend set by the
caller). They are meant to be read, so: tick labels are plain numbers (128, 256; 400, not
4×10²); each median carries an error bar over its rounds' min–max; the roofline is drawn, and
when a measurement beats it the plot says the ceilings are stale; latency distributions are step
CDFs with p50 and p99 marked; the chunked-prefill timeline runs against wall time with the long
prompt's arrival marked; a missing baseline is named with its reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from twophase.bench.results import above_roofline, tokens_range
from twophase.measure import machine

STALE = ("measured above the roofline: the ceilings are probably stale;\n"
         "run `twophase calibrate --force` on a quiet machine")


def plain(v: float, _pos: Any = None) -> str:
    """A tick label as people write numbers: 0.5, 2, 400, 12,000."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"


def _ticks(lo: float, hi: float) -> list[float]:
    """Plain log-axis ticks covering [lo, hi]: 1-2-5 steps, every digit over less than a decade,
    from the last at or below ``lo`` to the first at or above ``hi``."""
    digits = (1, 2, 5) if hi > 10 * lo else (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    every = sorted(d * 10.0 ** k for k in decades for d in digits)
    first = max(t for t in every if t <= lo * (1 + 1e-9))
    last = min(t for t in every if t >= hi * (1 - 1e-9))
    return [t for t in every if first <= t <= last]


def _log_axis(ax, which: str, values: list[float], fixed: list[float] | None = None) -> None:
    """A log axis labelled in plain numbers: at ``fixed`` if given, else at ``_ticks`` of the
    data, the axis reaching the ticks either side so both ends are labelled."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    ticks = fixed or _ticks(min(values), max(values))
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(plain))
    axis.set_minor_formatter(NullFormatter())
    if not fixed:
        (ax.set_xlim if which == "x" else ax.set_ylim)(ticks[0] / 1.05, ticks[-1] * 1.05)


def _notes(fig, notes: list[tuple[str, str]]) -> float:
    """Notes under the axes, one colour each; returns the figure fraction they take."""
    y = 0.01
    for text, colour in reversed(notes):
        fig.text(0.01, y, text, fontsize=8, color=colour, va="bottom", ha="left")
        y += 0.035 * (text.count("\n") + 1)
    return y if notes else 0.0


def _machine_notes(res: dict[str, Any]) -> list[tuple[str, str]]:
    notes = []
    if machine.busy_reasons(res.get("machine")):
        notes.append(("the machine was not quiet during this bench: figures are slow and noisy "
                      "(see report.md)", "darkorange"))
    if res.get("baseline_missing"):
        notes.append((f"no HF baseline: {res['baseline_missing']}", "dimgray"))
    return notes


def _save(fig, path: Path, notes: list[tuple[str, str]]) -> str:
    fig.tight_layout(rect=(0, _notes(fig, notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def phase(res: dict[str, Any], phase: str, out: Path) -> str:
    """Tokens/s against prompt length or batch size, each line with its min–max, and the bound."""
    xs = res["shapes"][phase]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ys: list[float] = []
    for line in res["lines"]:
        pts = [(x, res[phase][line][str(x)]) for x in xs if str(x) in res[phase][line]]
        if not pts:
            continue
        med = [m["tokens_per_s"] for _, m in pts]
        lo, hi = zip(*(tokens_range(m, x) for x, m in pts))
        ax.errorbar([x for x, _ in pts], med, yerr=[[a - b for a, b in zip(med, lo)],
                                                    [b - a for a, b in zip(med, hi)]],
                    marker="o", capsize=3, label=f"{line}")
        ys += [*lo, *hi]
    bound = [res["roofline"][f"{phase}_bound_tokens_per_s"][str(x)] for x in xs]
    when = res["ceilings"].get("measured_at", "")[:10] or "undated"
    ax.plot(xs, bound, "k--", zorder=5, label=f"roofline bound (ceilings of {when})")
    _log_axis(ax, "x", xs, fixed=xs)
    _log_axis(ax, "y", ys + bound)
    ax.set_xlabel("prompt tokens" if phase == "prefill" else "batch size")
    ax.set_ylabel("tokens/s (median, bars: min–max of rounds)")
    title = f"{phase}: {res['model']} on {res['device']}"
    if phase == "decode":
        title += f", context {res['decode_context']}"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    notes = [(STALE, "red")] if any(a[0] == phase for a in above_roofline(res)) else []
    return _save(fig, out / f"{phase}_tokens_per_s.png", notes + _machine_notes(res))


def _cdf(ax, line: str, vals_ms: list[float], stats: dict[str, Any]) -> None:
    """A step CDF with p50 and p99 marked on it."""
    p50, p99 = stats["p50"] * 1e3, stats["p99"] * 1e3
    art = ax.ecdf(vals_ms, label=f"{line}: p50 {p50:.1f}, p99 {p99:.1f} ms")
    colour = art.get_color()
    ax.plot([p50], [0.5], "o", color=colour, ms=6)
    ax.plot([p99], [0.99], "s", color=colour, ms=6)


def latency(res: dict[str, Any], out: Path) -> str:
    """TTFT and ITL distributions of the serving workload, one step CDF a line."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    untimed = []
    for ax, key, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "inter-token latency (ms)")):
        shown: list[float] = []
        for line, s in res["serving"].items():
            vals = [v * 1e3 for v in s.get(f"{key}_values", [])]
            if not vals:
                untimed.append(line)
                continue
            _cdf(ax, line, vals, s[f"{key}_s"])
            shown += vals
        if shown:
            _log_axis(ax, "x", [v for v in shown if v > 0] or [1.0])
        ax.set_xlabel(label + "; ● p50, ■ p99")
        ax.set_ylabel("fraction of requests" if key == "ttft" else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"serving latency: {res['serving_workload']}", fontsize=9)
    notes = [(f"{line}: throughput only (static batches through generate record no per-token "
              f"times)", "dimgray") for line in dict.fromkeys(untimed)]
    return _save(fig, out / "ttft_itl.png", notes + _machine_notes(res))


def chunked(res: dict[str, Any], out: Path) -> str:
    """The running decodes' inter-token latency against wall time while a long prompt arrives:
    one panel for chunked prefill on, one for off, on the same axes."""
    runs = res["chunked"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 + 2 * len(runs)), sharex=True, sharey=True,
                             squeeze=False)
    timed = all("itl_timeline_at_s" in s for s in runs.values())
    for ax, (mode, s), colour in zip(axes[:, 0], runs.items(), ("tab:blue", "tab:orange")):
        gaps = [v * 1e3 for v in s["itl_timeline"]]
        at = [t * 1e3 for t in s["itl_timeline_at_s"]] if timed else list(range(len(gaps)))
        ax.plot(at, gaps, ".-", lw=0.8, ms=3, color=colour, label=f"chunked prefill {mode}")
        if timed:
            arrive, first = s["long_prompt_arrival_s"] * 1e3, s["long_prompt_first_token_s"] * 1e3
            ax.axvline(arrive, color="k", ls="--", lw=1, label="long prompt arrives")
            ax.axvspan(arrive, first, color="k", alpha=0.08, label="until its first token")
        ax.set_ylabel("ITL (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    top = max((v for s in runs.values() for v in s["itl_timeline"]), default=0.001) * 1e3
    axes[0, 0].set_ylim(0, top * 1.08)                  # shared: every spike whole, on both panels
    axes[-1, 0].set_xlabel("wall time since the run started (ms)" if timed
                           else "output token of running decodes, in time order")
    axes[0, 0].set_title(f"inter-token latency of running decodes while a {res['chunked_long_prompt']}-token "
                         f"prompt arrives", fontsize=10)
    return _save(fig, out / "chunked_itl.png", _machine_notes(res))
