"""``--search KEY=V1,V2,...``: every combination of the values, each simulated on the same
workload, ranked by goodput per device (a deployment of four GPUs must serve four times one's
to rank above it), then by throughput."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from rich.table import Table

from twophase.cli.terminal import styled
from twophase.errors import ConfigError


def parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse(specs: list[str]) -> dict[str, list[Any]]:
    """``["scheduler.max_num_seqs=16,64"]`` -> ``{"scheduler.max_num_seqs": [16, 64]}``."""
    out: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or "." not in key or not values.strip():
            raise ConfigError("--search", f"expected SECTION.KEY=V1,V2,...; got {spec!r}")
        out[key] = [parse_value(v) for v in values.split(",") if v.strip()]
    return out


def nested(key: str, value: Any) -> dict[str, Any]:
    """``"scheduler.max_num_seqs", 16`` -> ``{"scheduler": {"max_num_seqs": 16}}``."""
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def combinations(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def overrides(combo: dict[str, Any]) -> dict[str, Any]:
    """``{"scheduler.max_num_seqs": 16}`` -> the nested config override it stands for."""
    out: dict[str, Any] = {}
    for k, v in combo.items():
        out = merge(out, nested(k, v))
    return out


def search(grid: dict[str, list[Any]], simulate: Callable[[dict[str, Any]], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each combination's ``simulate(overrides)`` result (a nested config override), best
    goodput per device first (then output throughput). A combination the config refuses is
    listed with its error."""
    rows: list[dict[str, Any]] = []
    for combo in combinations(grid):
        try:
            result = simulate(overrides(combo))
        except ConfigError as exc:
            rows.append({"settings": combo, "error": str(exc)})
            continue
        r, s = result["report"], result["simulation"]
        rows.append({"settings": combo, "devices": s["devices"],
                     "goodput_per_device_rps": s["goodput"]["goodput_per_device_rps"],
                     "goodput_rps": s["goodput"]["goodput_rps"] or 0.0,
                     "attainment": s["goodput"]["attainment"], "output_tokens_per_s": r["output_tokens_per_s"],
                     "ttft_p50_s": r["ttft_s"]["p50"], "ttft_p99_s": r["ttft_s"]["p99"],
                     "tpot_p50_s": r["tpot_s"]["p50"], "tpot_p99_s": r["tpot_s"]["p99"],
                     "preemptions": r["preemptions"], "num_blocks": s["num_blocks"]})
    return sorted(rows, key=lambda x: ("error" in x, -x.get("goodput_per_device_rps", 0.0),
                                       -(x.get("output_tokens_per_s") or 0.0)))


def table(rows: list[dict[str, Any]]) -> Table:
    keys = list(rows[0]["settings"]) if rows else []
    t = Table(title="search, ranked by goodput per device")
    for col in ("#", *keys, "devices", "goodput req/s", "per device", "SLO met", "out tok/s", "TTFT p50/p99 ms",
                "TPOT p50/p99 ms", "preempt."):
        t.add_column(col, justify="right")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    for i, r in enumerate(rows, 1):
        cells = [str(r["settings"][k]) for k in keys]
        if "error" in r:
            t.add_row(str(i), *cells, "", styled((r["error"], "red")), "", "", "", "", "", "")
            continue
        t.add_row(str(i), *cells, str(r["devices"]), f"{r['goodput_rps']:.3f}",
                  f"{r['goodput_per_device_rps']:.3f}",
                  "-" if r["attainment"] is None else f"{100 * r['attainment']:.0f}%",
                  f"{r['output_tokens_per_s'] or 0:.1f}", f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}",
                  f"{ms(r['tpot_p50_s'])} / {ms(r['tpot_p99_s'])}", str(r["preemptions"]))
    return t
