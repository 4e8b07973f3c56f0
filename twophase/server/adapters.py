"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, as vLLM names them: adapters
added and removed while the server runs (behind the server's API key where one is set). The
change runs on the engine's thread between steps, so no step sees half of it; a request in
flight keeps its adapter (unloading one in use is refused)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from twophase.lora.peft_adapter import AdapterError
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of

router = APIRouter()

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]


class LoadAdapter(BaseModel):
    model_config = P.STRICT
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadAdapter(BaseModel):
    model_config = P.STRICT
    lora_name: Name
    lora_int_id: int | None = None           # vLLM's; the name is what identifies an adapter here


def _manager(server: ServerState) -> Any:
    if server.adapters is None:
        raise P.ApiError(400, "this server serves no adapters: its backends do not apply them "
                              "(serve with backend torch)", "lora_name")
    return server.adapters


def _api_error(exc: AdapterError, field: str) -> P.ApiError:
    if exc.not_found:
        return P.ApiError(404, str(exc), field, type_="not_found_error", code="adapter_not_found")
    return P.ApiError(400, str(exc), field, code="adapter_busy" if exc.busy else "invalid_adapter")


@router.post("/v1/load_lora_adapter")
async def load_adapter(body: LoadAdapter, request: Request):
    server = state_of(request)
    manager = _manager(server)
    if body.lora_name == server.model_name:
        raise P.ApiError(400, f"{body.lora_name!r} is the base model's name", "lora_name")
    try:
        await server.loop.run(lambda: manager.register(body.lora_name, body.lora_path, load_now=True))
    except AdapterError as exc:
        raise _api_error(exc, "lora_path" if not exc.not_found and "already" not in str(exc)
                         else "lora_name") from None
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}


@router.post("/v1/unload_lora_adapter")
async def unload_adapter(body: UnloadAdapter, request: Request):
    server = state_of(request)
    manager = _manager(server)
    try:
        await server.loop.run(lambda: manager.unregister(body.lora_name))
    except AdapterError as exc:
        raise _api_error(exc, "lora_name") from None
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
