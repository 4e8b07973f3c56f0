"""The OpenAI-compatible HTTP API over one engine: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses`` (all streaming as server-sent events),
``/v1/embeddings``, ``/v1/models``, ``/tokenize`` and ``/detokenize`` (vLLM's),
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's), ``/health``, ``/metrics``
(Prometheus). One module per endpoint; this one assembles them.

Every request goes through a ``Loop`` (one engine's ``EngineLoop``, or ``ClusterLoop`` over
engines on Ray), so concurrent clients batch together. Bad input gets
an OpenAI error object with status 400; past the queue limit a request gets 503; nothing a
client sends can crash the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from twophase.server import adapters, chat, completions, embeddings, info, responses, tokenize
from twophase.server import protocol as P
from twophase.server.loop import EngineLoop, Loop
from twophase.server.metrics import ServerMetrics
from twophase.server.middleware import Gate
from twophase.server.state import ServerState

ENDPOINTS = (info, completions, chat, responses, tokenize, adapters, embeddings)  # each module's ``router``


def create_app(llm, model_name: str, api_key: str | None = None, max_queue: int = 256,
               default_max_tokens: int = 256, max_body_bytes: int = 4 << 20,
               on_fatal: Callable[[BaseException], None] | None = None, max_n: int = 16) -> FastAPI:
    """The app over ``llm``, in this process. ``on_fatal`` is called (on the engine's thread)
    if the engine stops for good; ``twophase serve`` then shuts the server down and exits
    non-zero."""
    metrics = ServerMetrics()
    engine = llm.engine
    metrics.kv_total.set(engine.stats().total_blocks)
    metrics.loaded(llm.memory)
    loop = EngineLoop(llm, max_queue, on_step=metrics.step, on_finish=metrics.finished,
                      on_change=lambda: metrics.refresh(engine.stats(), llm.adapters, engine.tier_stats()),
                      on_fatal=on_fatal)
    return build_app(loop, llm.tokenizer, metrics, model_name, api_key, default_max_tokens,
                     max_body_bytes, max_n, llm.adapters, hidden_size=llm.model.arch.hidden_size)


def build_app(loop: Loop, tokenizer, metrics: ServerMetrics, model_name: str,
              api_key: str | None = None, default_max_tokens: int = 256,
              max_body_bytes: int = 4 << 20, max_n: int = 16, lora: Any = None,
              hidden_size: int | None = None) -> FastAPI:
    """The HTTP layer over any ``Loop``: one engine here (``EngineLoop``) or engines on Ray
    (``twophase.cluster.frontend.ClusterLoop``). ``lora``: the engine's ``LoraManager``, for
    requests naming adapters (None: the base model only, as behind a cluster)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        loop.close()

    app = FastAPI(title="twophase", lifespan=lifespan)
    app.state.server = ServerState(tokenizer, loop, metrics, model_name, default_max_tokens, max_n, lora,
                                   hidden_size)
    app.state.loop, app.state.metrics = loop, metrics
    _add_error_handlers(app)
    routes = [r for module in ENDPOINTS for r in module.router.routes]
    app.add_middleware(Gate, api_key=api_key, metrics=metrics, routes=routes,
                       max_body_bytes=max_body_bytes)
    for module in ENDPOINTS:
        app.include_router(module.router)
    return app


def _error(exc: P.ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _most_telling(errors) -> dict:
    """The error to report: for a field that takes several forms (``stop``: a string or a list),
    pydantic reports each form's failure; a broken limit ("at most 16 items") says more than
    "should be a valid string" for the form the client did not send."""
    mismatch = [e for e in errors if str(e.get("type", "")).endswith("_type")]
    return next((e for e in errors if e not in mismatch), errors[0])


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _body_problem(request: Request, error: dict) -> str:
    """What is wrong with a body that is not an object's fields at all."""
    content_type = request.headers.get("content-type", "")
    if error.get("type") == "missing":
        return "the request body is empty: it must be a JSON object"
    if "json" not in content_type.lower():          # the body was not read as JSON at all
        return (f"the request body must be a JSON object sent with Content-Type: "
                f"application/json (got {content_type or 'no Content-Type'!r})")
    kind = _JSON_KINDS.get(type(error.get("input")), "not an object")
    return f"the request body must be a JSON object, got {kind}"


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object."""

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, exc: P.ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = _most_telling(exc.errors())
        # the field (OpenAI's ``param``); deeper parts of pydantic's path name union members
        param = next((str(x) for x in first.get("loc", ()) if x != "body"), None)
        if first.get("type") == "json_invalid":
            return _error(P.ApiError(400, "the request body is not valid JSON"))
        if param is None:                    # the body itself: empty, not JSON, or not an object
            return _error(P.ApiError(400, _body_problem(request, first)))
        if first.get("type") == "extra_forbidden":
            return _error(P.ApiError(400, f"unsupported parameter: {param}", param,
                                     code="unsupported_parameter"))
        if first.get("type") == "missing":
            field = str(first["loc"][-1])         # a nested field: named, with the parameter it is in
            where = param if field == param else f"{field} (in {param})"
            return _error(P.ApiError(400, f"missing required parameter: {where}", param))
        return _error(P.ApiError(400, f"{param}: {first.get('msg')}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(P.ApiError(exc.status_code, str(exc.detail), type_=kind))
