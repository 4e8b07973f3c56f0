"""API-key checking and response counting, below every route."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from twophase.server import protocol as P
from twophase.server.metrics import ServerMetrics


class KeyAndCount:
    """Checks the API key (every route but /health) and counts responses by route and status.
    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` hides the client's disconnect
    from handlers, and noticing it is how a request is aborted."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"]
        status = {}

        async def send_counting(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.api_key and route != "/health" and \
                headers.get(b"authorization", b"").decode() != f"Bearer {self.api_key}":
            err = P.ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                             type_="authentication_error", code="invalid_api_key")
            return await JSONResponse(err.body(), status_code=401)(scope, receive, send_counting)
        await self.app(scope, receive, send_counting)
