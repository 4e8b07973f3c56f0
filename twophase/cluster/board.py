"""The workers' Prometheus figures for one ``/metrics``: each worker posts its exposition text
to a named actor every second; the frontend reads them all and labels each with its worker.
A worker that stops posting (it died) drops out after ``STALE_S``."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

BOARD = "twophase-metrics"
POST_EVERY_S = 1.0
STALE_S = 5.0


class MetricsBoard:
    def __init__(self) -> None:
        self.posts: dict[str, tuple[float, str]] = {}

    def post(self, worker: str, text: str) -> None:
        self.posts[worker] = (time.monotonic(), text)

    def collect(self) -> dict[str, str]:
        now = time.monotonic()
        self.posts = {k: v for k, v in self.posts.items() if now - v[0] <= STALE_S}
        return {k: text for k, (_, text) in self.posts.items()}


def labelled(posts: dict[str, str]) -> str:
    """One exposition of every worker's samples, each with a ``replica`` label (its name)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for worker, text in sorted(posts.items()):
        for fam in text_string_to_metric_families(text):
            kind = "untyped" if fam.type == "unknown" else fam.type
            _, _, lines = families.setdefault(fam.name, (kind, fam.documentation, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": worker}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {_number(s.value)}")
    out = []
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))
