"""The routes that generate nothing: ``/health``, ``/metrics`` (Prometheus), ``/v1/models``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 while the engine steps; 503 once it has stopped (a supervisor should restart us)."""
    loop = state_of(request).loop
    if not loop.alive:
        return JSONResponse({"status": "error", "error": f"the engine has stopped: {loop.fatal}"},
                            status_code=503)
    return {"status": "ok", "requests_in_flight": loop.in_flight}


@router.get("/metrics")
async def prometheus(request: Request):
    metrics = state_of(request).metrics
    body = await asyncio.to_thread(metrics.exposition)      # replicas' figures come over Ray
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _model(name: str, server: ServerState) -> dict:
    """The base model, or an adapter over it (``parent``: the base, ``root``: its folder)."""
    out = {"id": name, "object": "model", "created": P.now(), "owned_by": "twophase"}
    if name != server.model_name:
        out |= {"parent": server.model_name, "root": str(server.adapters.known[name])}
    return out


@router.get("/v1/models")
async def models(request: Request):
    server = state_of(request)
    names = [server.model_name, *sorted(server.adapter_names())]
    return {"object": "list", "data": [_model(n, server) for n in names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    server = state_of(request)
    server.adapter_of(model_id)
    return _model(model_id, server)
