"""The routes that generate nothing: ``/health``, ``/metrics`` (Prometheus), ``/v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from twophase.server import protocol as P
from twophase.server.state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    return {"status": "ok", "requests_in_flight": state_of(request).loop.in_flight}


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [{"id": state_of(request).model_name, "object": "model",
                                        "created": P.now(), "owned_by": "twophase"}]}
