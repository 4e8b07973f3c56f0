"""What every HTTP request passes through before its route: the request-body limit, the API key,
one access-log line, and the response count by route template and status.

A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` hides the client's disconnect from
handlers, and noticing it is how a request is aborted.
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from twophase.server import protocol as P
from twophase.server.metrics import ServerMetrics

access_log = logging.getLogger("twophase.access")
OPEN_ROUTES = {"/health"}             # answered without the API key


class Gate:
    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, routes: list[BaseRoute],
                 max_body_bytes: int):
        self.app, self.metrics, self.routes = app, metrics, routes
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        route = self._route(scope)       # a template: a label per route, never per raw path
        status = {"code": 0}

        async def send_counting(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            refusal = self._refusal(scope, route)
            if refusal is None:
                body, refusal = await self._read_body(scope, receive)
            if refusal is not None:
                headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
                await JSONResponse(refusal.body(), refusal.status, headers)(scope, receive, send_counting)
                return
            if body is None:                 # the client left while sending
                return
            try:
                await self.app(scope, _replay(body, receive), send_counting)
            except Exception:
                if not status["code"]:       # the 500 the error middleware above will send
                    status["code"] = 500
                    self.metrics.requests.labels(route, "500").inc()
                raise
        finally:
            client = scope.get("client") or ("-", 0)
            path = scope["path"].encode("unicode_escape").decode("ascii")    # one line, always
            access_log.info('%s "%s %s" %d %.0f ms', client[0], scope["method"], path,
                            status["code"], 1000 * (time.perf_counter() - start))

    def _route(self, scope) -> str:
        for r in self.routes:
            match, _ = r.matches(scope)
            if match is not Match.NONE:
                return getattr(r, "path", "?")
        return "unmatched"

    def _refusal(self, scope, route: str) -> P.ApiError | None:
        """A missing or wrong API key (compared in constant time; ``Bearer`` in any case)."""
        if self.key is None or route in OPEN_ROUTES:
            return None
        value = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return P.ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                          type_="authentication_error", code="invalid_api_key")

    async def _read_body(self, scope, receive) -> tuple[list[dict] | None, P.ApiError | None]:
        """The whole body, refused past ``max_body_bytes`` (by its declared length at once, or
        as it arrives); None if the client left."""
        too_big = P.ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes "
                                  f"(server.max_body_bytes)", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return [], too_big
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return [], too_big
            messages.append(message)
            if not message.get("more_body", False):
                return messages, None


def _replay(messages: list[dict], receive):
    """A ``receive`` that hands out the body already read, then the client's own (for the
    disconnect that aborts a request)."""
    async def replay():
        if messages:
            return messages.pop(0)
        return await receive()
    return replay
