"""A real server for tests: uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from twophase import LLM
from twophase.server.app import create_app

MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(llm: LLM, **kwargs):
    with serving_app(create_app(llm, MODEL, **kwargs)) as (url, app):
        yield url, app


@contextmanager
def serving_app(app):
    """Any app (``build_app`` over engines on Ray too) on a free port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def all_blocks_free(llm: LLM, app, timeout: float = 10.0) -> None:
    """Wait for the engine to settle, then every block must be free."""
    deadline = time.monotonic() + timeout
    while app.state.loop.in_flight or llm.engine.has_unfinished():
        assert time.monotonic() < deadline, f"{app.state.loop.in_flight} requests still in flight"
        time.sleep(0.05)
    assert llm.engine.kv.num_free_blocks == llm.num_blocks


