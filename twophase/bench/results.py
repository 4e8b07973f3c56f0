"""What a bench's results say, read alike by its tables and reports (``bench/report.py``) and its
plots (``bench/plots.py``)."""

from __future__ import annotations

from typing import Any


def tokens_range(m: dict[str, Any], tokens: float) -> tuple[float, float]:
    """(slowest, fastest) tokens/s over the rounds of a measurement."""
    return tokens / m["max_s"], tokens / m["min_s"]


def above_roofline(res: dict[str, Any]) -> list[tuple[str, Any, str, float]]:
    """(phase, shape, line, fraction) of every median measured faster than its bound allows."""
    return [(phase, key, line, m["roofline_fraction"])
            for phase in ("prefill", "decode") for line in res["lines"]
            for key, m in res[phase][line].items() if m["roofline_fraction"] > 1]
