"""``twophase serve``: the port taken before the model loads, uvicorn over the app, a shutdown
deadline, and a non-zero exit if the engine stops for good. The app and its engine loop come
from the factory the caller gives (``AppFactory``): ``local_app`` is one engine in this process;
the command line chooses it or the Ray cluster's."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from twophase.config import Config
from twophase.errors import TwophaseError, install_hint

log = logging.getLogger("twophase")
SHUTDOWN_MESSAGE = "the server is shutting down"

# (cfg, api_key, on_fatal) -> (app, served name, close(stopped)): the app's ``state.loop`` is the
# engine loop; ``on_fatal`` is called if the engine stops for good; ``close`` runs after the loop's
# close, told whether it stopped
AppFactory = Callable[[Config, str | None, Callable[[BaseException], None]],
                      tuple[Any, str, Callable[[bool], None]]]


def check_installed() -> None:
    """The ``serve`` extra, named, instead of a ``ModuleNotFoundError`` traceback."""
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise TwophaseError(f"twophase serve needs {', '.join(missing)}: {install_hint('serve')}")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken now: a busy port fails before minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TwophaseError(f"cannot listen on {host}:{port}: {exc.strerror} (--port / server.port, "
                            f"--host / server.host)") from None
    sock.listen(2048)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: Config, host: str, port: int, api_key: str | None, make_app: AppFactory) -> int:
    check_installed()
    import uvicorn

    sv = cfg.server
    if not api_key and not is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use "
                    "it (--api-key, server.api_key or $TWOPHASE_API_KEY)", host)
    sock = bind(host, port)
    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server is not None:
            server.should_exit = True

    app, name, close = make_app(cfg, api_key, on_fatal)
    stopped = True
    try:
        config = uvicorn.Config(app, log_level="warning",
                                timeout_graceful_shutdown=int(sv.shutdown_timeout_s) + 5)
        server = _server(config, app.state.loop, sv.shutdown_timeout_s)
        log.info("serving %s at http://%s:%d/v1 (API key %s; limits: %d requests in flight, "
                 "%d-byte bodies, %g s to finish at shutdown)", name, host, sock.getsockname()[1],
                 "required" if api_key else "off", sv.max_queue, sv.max_body_bytes,
                 sv.shutdown_timeout_s)
        try:
            server.run(sockets=[sock])
        finally:
            stopped = app.state.loop.close()       # also where uvicorn skipped its lifespan
    finally:
        close(stopped)
    if fatal:
        raise TwophaseError(f"the engine stopped: {fatal[0]}")
    return 0


def local_app(cfg: Config, api_key: str | None, on_fatal: Callable[[BaseException], None]):
    """One engine in this process: the app, the served name, and how to close it."""
    from twophase.llm import LLM
    from twophase.server.app import create_app

    sv = cfg.server
    llm = LLM(cfg)
    try:
        name = sv.model_name or llm.model.model_id
        app = create_app(llm, name, api_key, sv.max_queue, sv.default_max_tokens, sv.max_body_bytes,
                         on_fatal=on_fatal, max_n=sv.max_n)
    except BaseException:
        llm.close()
        raise

    def close(stopped: bool) -> None:
        if stopped:                                 # never close backends under a running step
            llm.close()
        else:
            log.warning("the engine is still in a step; its backends are left to the process exit")

    return app, name, close


def _server(config, loop, deadline_s: float):
    """uvicorn's server, plus a deadline: streams still open that long after SIGTERM (or
    Ctrl-C) end with an error event, so shutdown never waits on a client for ever."""
    import uvicorn

    class DeadlineServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                timer = threading.Timer(deadline_s, loop.fail_all, [SHUTDOWN_MESSAGE])
                timer.daemon = True
                timer.start()

    return DeadlineServer(config)
