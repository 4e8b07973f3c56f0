"""The app of ``twophase serve`` with ``[cluster]``: engines on Ray behind the same routes as one
engine (``twophase.server.serve.AppFactory``). Nothing is imported until it is called, so the
serve extra is checked first and the cluster extra is named before anything imports Ray."""

from __future__ import annotations

import signal
from collections.abc import Callable

from twophase.config import Config


def cluster_app(cfg: Config, api_key: str | None, on_fatal: Callable[[BaseException], None]):
    """Engines on Ray (``[cluster]``) behind the same app."""
    from twophase.cluster import launch

    launch.check_installed()               # the cluster extra, named, before anything imports Ray
    from twophase.cluster.frontend import ClusterLoop
    from twophase.server.app import build_app
    from twophase.server.metrics import ServerMetrics

    sv = cfg.server
    cluster = launch.start(cfg)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # Ray's own would print a traceback
    try:
        info = cluster.info
        name = sv.model_name or info["model_id"]
        loop = ClusterLoop(cluster, cluster.tokenizer(), info["max_model_len"], sv.max_queue)
        app = build_app(loop, loop.tokenizer, ServerMetrics(extra=cluster.metrics_text), name,
                        api_key, sv.default_max_tokens, sv.max_body_bytes, sv.max_n)
    except BaseException:
        cluster.shutdown()
        raise
    return app, name, lambda stopped: cluster.shutdown()
