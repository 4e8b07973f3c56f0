"""``twophase serve`` as a user runs it: a missing extra or a busy port is one clear line (the
port before the model loads), SIGTERM ends open streams with an error within the shutdown
deadline and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers.server import free_port

pytest.importorskip("uvicorn")

TINY = '[model]\nname = "tiny"\nweights = "random"\n'


def _serve(cfg, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "twophase", "serve", str(cfg), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = _serve(cfg, "--port", str(port))
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert "loaded" not in err and "Traceback" not in err


def test_a_public_address_without_a_key_is_warned_about(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    with socket.socket() as held:                # busy, so serve stops right after the warning
        held.bind(("0.0.0.0", 0))
        held.listen(1)
        proc = _serve(cfg, "--host", "0.0.0.0", "--port", str(held.getsockname()[1]),
                      env={"TWOPHASE_API_KEY": ""})
        _, err = proc.communicate(timeout=120)
    assert "without an API key" in err and "cannot listen" in err


def test_without_the_serve_extra_it_names_the_extra(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    code = ("import sys; sys.modules['uvicorn'] = None; from twophase.cli import main; "
            f"raise SystemExit(main(['serve', {str(cfg)!r}]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "pip install -e '.[serve]'" in run.stderr and "Traceback" not in run.stderr


def test_sigterm_ends_open_streams_within_the_deadline(tmp_path):
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY + f"[server]\nport = {port}\nshutdown_timeout_s = 1.0\n")
    proc = _serve(cfg)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - sent < 20
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        # a graceful exit; uvicorn then re-raises the signal it caught, so the status says SIGTERM
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
