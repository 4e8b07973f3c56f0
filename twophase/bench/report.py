"""The bench's outputs: terminal tables (rich), ``results.json``, ``report.md`` and PNG plots.
Everything is drawn from the results dict alone, so a saved ``results.json`` can be re-rendered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale and unit:
            return f"{v / scale:.1f} {prefix}{unit}"
    return f"{v:.1f}{' ' + unit if unit else ''}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def phase_rows(res: dict[str, Any], phase: str) -> list[list[str]]:
    """One row per (shape, line): tokens/s, ratio to the first line, FLOP/s, GB/s, % of bound."""
    rows = []
    lines = res["lines"]
    for key in res["shapes"][phase]:
        base = res[phase][lines[0]].get(str(key), {}).get("tokens_per_s")
        for line in lines:
            m = res[phase][line].get(str(key))
            if m is None:
                continue
            ratio = f"x{m['tokens_per_s'] / base:.2f}" if base else "-"
            spread = f"{m['min_s'] * 1e3:.1f}–{m['max_s'] * 1e3:.1f}"
            rows.append([str(key), line, f"{m['tokens_per_s']:.1f}", ratio,
                         f"{m['median_s'] * 1e3:.2f} ({spread})", _fmt(m["flops_per_s"], "FLOP/s"),
                         _fmt(m["bytes_per_s"], "B/s"), f"{100 * m['roofline_fraction']:.0f}%"])
    return rows


PHASE_COLUMNS = ["shape", "line", "tokens/s", "ratio", "ms/step (min–max)", "achieved FLOP/s",
                 "achieved bytes/s", "of roofline"]
SERVING_COLUMNS = ["line", "req/s", "output tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                   "ITL p50/p99 ms", "E2E p50/p99 ms", "max decode batch"]


def serving_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for line, s in res["serving"].items():
        if "ttft_s" not in s:        # the HF reference: throughput only
            rows.append([line, f"{s['request_throughput']:.2f}", f"{s['output_tokens_per_s']:.1f}",
                         "-", "-", "-", "-", f"static batch {s['batch_size']}"])
            continue
        rows.append([line, f"{s['request_throughput']:.2f}", f"{s['output_tokens_per_s']:.1f}",
                     *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p99'])}" for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")),
                     str(s["max_decode_batch"])])
    for mode, s in res.get("chunked", {}).items():
        rows.append([f"{res['lines'][0]}, chunked prefill {mode}", f"{s['request_throughput']:.2f}",
                     f"{s['output_tokens_per_s']:.1f}",
                     *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p99'])}" for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")),
                     f"ITL max {_ms(max(s['itl_values'], default=0))} ms"])
    return rows


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
        f"calibrate`: {_fmt(c['peak_flops'], 'FLOP/s')} matmul peak, {_fmt(c['bandwidth'], 'B/s')} "
        f"memory bandwidth (ridge {c['peak_flops'] / c['bandwidth']:.1f} FLOP/byte).",
        f"Arithmetic intensity: prefill {rf['prefill_intensity']:.0f} FLOP/byte at "
        f"{rf['prefill_intensity_at']} tokens, decode {rf['decode_intensity_b1']:.2f} at batch 1 "
        f"(context {res['decode_context']}); decode turns compute-bound at batch "
        f"{cross if cross else 'never (the K/V read grows with the batch)'}.",
        *spec,
        *res.get("skipped", []),
    ]


def print_tables(res: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for text in headline(res):
        console.print(text)
    for phase, title in (("prefill", "prefill (prompt tokens/s)"), ("decode", "decode (tokens/s)")):
        t = Table(title=title + f", median of {res['repeats']} interleaved rounds")
        for col in PHASE_COLUMNS:
            t.add_column(col, justify="left" if col in ("line",) else "right")
        for row in phase_rows(res, phase):
            t.add_row(*row)
        console.print(t)
    t = Table(title=f"serving: {res['serving_workload']}")
    for col in SERVING_COLUMNS:
        t.add_column(col, justify="left" if col == "line" else "right")
    for row in serving_rows(res):
        t.add_row(*row)
    console.print(t)


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(res: dict[str, Any], path: Path, plots: list[str]) -> None:
    parts = ["# twophase bench", "", *headline(res), "",
             f"Command: `{res['command']}`", "",
             "## Prefill", "", _md_table(PHASE_COLUMNS, phase_rows(res, "prefill")), "",
             "## Decode", "", _md_table(PHASE_COLUMNS, phase_rows(res, "decode")), "",
             "## Serving", "", res["serving_workload"], "",
             _md_table(SERVING_COLUMNS, serving_rows(res)), "",
             "Ratios are to the first line, measured in the same run; 'of roofline' is the "
             "analytic lower bound on the step's time over the measured time.", ""]
    parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    path.write_text("\n".join(parts) + "\n")


def plot(res: dict[str, Any], out: Path) -> list[str]:
    """PNG plots; returns their paths (none, with a warning, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        import logging

        logging.getLogger(__name__).warning("no plots: matplotlib is not installed "
                                            "(pip install 'twophase[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for phase, xlabel, bound_key in (("prefill", "prompt tokens", "prefill_bound_tokens_per_s"),
                                     ("decode", "batch size", "decode_bound_tokens_per_s")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = res["shapes"][phase]
        for line in res["lines"]:
            pts = [(x, res[phase][line][str(x)]["tokens_per_s"]) for x in xs if str(x) in res[phase][line]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=line)
        bound = res["roofline"][bound_key]
        ax.plot(xs, [bound[str(x)] for x in xs], "k--", label="roofline (calibrated ceilings)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens/s")
        title = f"{phase}: {res['model']} on {res['device']}"
        if phase == "decode":
            title += f", context {res['decode_context']}"
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        files.append(str(out / f"{phase}_tokens_per_s.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "ttft_values", "TTFT (ms)"), (axes[1], "itl_values", "ITL (ms)")):
        for line, s in res["serving"].items():
            vals = sorted(v * 1e3 for v in s.get(key, []))
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=line)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if key == "ttft_values" else "fraction of tokens")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"serving latency distributions: {res['serving_workload']}", fontsize=9)
    fig.tight_layout()
    files.append(str(out / "ttft_itl.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    if res.get("chunked"):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for mode, s in res["chunked"].items():
            ax.plot([v * 1e3 for v in s["itl_timeline"]], label=f"chunked prefill {mode}", alpha=0.8)
        ax.set_xlabel("output token of running decodes, in time order")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(f"a {res['chunked_long_prompt']}-token prompt arriving among decodes")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        files.append(str(out / "chunked_itl.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def write_all(res: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    plots = plot(res, out)
    write_markdown(res, out / "report.md", plots)
    return [out / "results.json", out / "report.md", *map(Path, plots)]
