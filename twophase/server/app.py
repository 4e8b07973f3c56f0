"""The OpenAI-compatible HTTP API over one engine: ``/v1/completions``,
``/v1/chat/completions`` (both streaming as server-sent events), ``/v1/models``, ``/health``,
``/metrics`` (Prometheus).

Every request goes through ``EngineLoop``, so concurrent clients batch together. A client that
disconnects, mid-stream or while waiting for a whole reply, has its request aborted and its KV
blocks freed at once. Bad input gets an OpenAI error object with status 400; past the queue limit
a request gets 503; nothing a client sends can crash the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from twophase.errors import RequestRejected
from twophase.server import protocol as P
from twophase.server.loop import EngineLoop, Finished, Handle, Overloaded
from twophase.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


def create_app(llm, model_name: str, api_key: str | None = None, max_queue: int = 256,
               default_max_tokens: int = 256) -> FastAPI:
    metrics = ServerMetrics()
    metrics.kv_total.set(llm.engine.kv.pool.num_blocks)
    engine = llm.engine
    loop = EngineLoop(llm, max_queue,
                      on_step=lambda rec: metrics.step(rec, engine.scheduler, engine.kv),
                      on_finish=metrics.finished)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        loop.close()

    app = FastAPI(title="twophase", lifespan=lifespan)
    app.state.loop, app.state.metrics, app.state.llm = loop, metrics, llm

    def error(exc: P.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, exc: P.ApiError):
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error(P.ApiError(400, "the request body is not valid JSON"))
        if first.get("type") == "extra_forbidden":
            return error(P.ApiError(400, f"unsupported parameter: {param}", param,
                                    code="unsupported_parameter"))
        if first.get("type") == "missing":
            return error(P.ApiError(400, f"missing required parameter: {param}", param))
        return error(P.ApiError(400, f"{param}: {first.get('msg')}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(P.ApiError(exc.status_code, str(exc.detail),
                                type_="not_found_error" if exc.status_code == 404 else "invalid_request_error"))

    app.add_middleware(KeyAndCount, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok", "requests_in_flight": loop.in_flight}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": P.now(), "owned_by": "twophase"}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise P.ApiError(400, f"model {name!r} is not served here; this server serves "
                                  f"{model_name!r}", "model", code="model_not_found")

    async def start(prompt, params) -> tuple[Handle, Any]:
        """Submit and wait for the first item, so refusals become a status, not a stream."""
        try:
            handle = loop.submit(prompt, params)
        except Overloaded as exc:
            raise P.ApiError(503, str(exc), type_="server_overloaded", code="overloaded") from None
        try:
            return handle, await handle.next()
        except RequestRejected as exc:
            raise P.ApiError(400, str(exc), "prompt", code="prompt_rejected") from None
        except asyncio.CancelledError:
            handle.abort()
            raise

    async def collect(request: Request, handle: Handle, first) -> list:
        """Every item of a non-streamed request; aborts it if the client goes away (checked
        every ``DISCONNECT_POLL_S``, whether or not tokens are arriving)."""
        items = [first]
        checked = asyncio.get_running_loop().time()
        try:
            while not isinstance(items[-1], Finished):
                try:
                    items.append(await asyncio.wait_for(handle.next(), DISCONNECT_POLL_S))
                except asyncio.TimeoutError:
                    pass
                now = asyncio.get_running_loop().time()
                if now - checked >= DISCONNECT_POLL_S:
                    checked = now
                    if await request.is_disconnected():
                        raise P.ApiError(499, "client disconnected")
        finally:
            handle.abort()                  # no-op once finished
        return items

    def sse(handle: Handle, first, chunk, final) -> StreamingResponse:
        async def events():
            try:
                item = first
                while True:
                    if isinstance(item, Finished):
                        for body in final(item):
                            yield f"data: {json.dumps(body)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    body = chunk(item)
                    if body is not None:
                        yield f"data: {json.dumps(body)}\n\n"
                    item = await handle.next()
            finally:
                handle.abort()           # no-op once finished; frees the blocks of a client gone
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body.model)
        params = body.params(default_max_tokens)
        n_lp = body.logprobs
        handle, first = await start(body.prompt, params)
        cid, created = P.new_id("cmpl"), P.now()

        def choice(text: str, reason, token_ids=(), logprobs=(), offset=0) -> dict:
            lp = (P.completion_logprobs(llm.tokenizer, list(token_ids), list(logprobs), offset)
                  if n_lp is not None else None)
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

        def obj(choices, usage=None) -> dict:
            return P.envelope(cid, "text_completion", created, model_name, choices, usage)

        if not body.stream:
            items = await collect(request, handle, first)
            done = items[-1].output
            return obj([choice(done.text, done.finish_reason, done.token_ids, done.logprobs)],
                       P.usage(len(done.prompt_token_ids), len(done.token_ids)))
        sent = {"chars": 0}

        def chunk(d):
            c = choice(d.text, None, d.token_ids, d.logprobs, sent["chars"])
            sent["chars"] += len(d.text)
            return obj([c])

        def final(f: Finished):
            done = f.output
            out = [obj([choice("", f.reason)])]
            if body.stream_options and body.stream_options.include_usage:
                out.append(obj([], P.usage(len(done.prompt_token_ids), len(done.token_ids))))
            return out

        return sse(handle, first, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatCompletionRequest, request: Request):
        check_model(body.model)
        if llm.tokenizer is None:
            raise P.ApiError(400, "this model has no tokenizer or chat template: use "
                                  "/v1/completions with token ids", "messages")
        params = body.params(default_max_tokens)
        prompt = llm.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages])
        handle, first = await start(prompt, params)
        cid, created = P.new_id("chatcmpl"), P.now()
        top = body.top_logprobs or 0

        def lp_of(token_ids, logprobs):
            return P.chat_logprobs(llm.tokenizer, list(token_ids), list(logprobs), top) \
                if body.logprobs else None

        def obj(kind: str, choices, usage=None) -> dict:
            return P.envelope(cid, kind, created, model_name, choices, usage)

        if not body.stream:
            items = await collect(request, handle, first)
            done = items[-1].output
            message = {"role": "assistant", "content": done.text}
            return obj("chat.completion", [{"index": 0, "message": message,
                                            "logprobs": lp_of(done.token_ids, done.logprobs),
                                            "finish_reason": done.finish_reason}],
                       P.usage(len(done.prompt_token_ids), len(done.token_ids)))
        state = {"role_sent": False}

        def chunk(d):
            delta: dict[str, Any] = {"content": d.text}
            if not state["role_sent"]:
                delta["role"] = "assistant"
                state["role_sent"] = True
            lp = lp_of(d.token_ids, d.logprobs) if body.logprobs else None
            return obj("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": lp,
                                                  "finish_reason": None}])

        def final(f: Finished):
            done = f.output
            out = [obj("chat.completion.chunk", [{"index": 0, "delta": {}, "logprobs": None,
                                                  "finish_reason": f.reason}])]
            if body.stream_options and body.stream_options.include_usage:
                out.append(obj("chat.completion.chunk", [], P.usage(
                    len(done.prompt_token_ids), len(done.token_ids))))
            return out

        return sse(handle, first, chunk, final)

    return app


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
