"""``POST /v1/embeddings``: inputs (text or token ids, one or a batch) as vectors.

Each input is prefill-only work for the engine that generates (``core/pooling.py``): the loop
submits it beside the generating requests and it joins their steps. Pooling is the model's
(its sentence-transformers config, else the last token's hidden state, unnormalised); beyond
OpenAI's API a client may ask for ``pooling`` (``last``, ``mean``, ``cls``) and ``normalize``.
"""

from __future__ import annotations

import base64
from functools import partial
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from twophase.core.outputs import RequestOutput
from twophase.core.pooling import PoolingParams
from twophase.errors import RequestRejected
from twophase.server import protocol as P
from twophase.server.state import ServerState, state_of
from twophase.server.streaming import collect, started

router = APIRouter()

MAX_INPUTS = 256                   # inputs in one request

Ids = Annotated[list[P.TokenId], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    model_config = P.STRICT
    model: str
    # one input (text or token ids), or a batch of them: one vector each, in order
    input: P.Text | Ids | Annotated[list[P.Text], Field(min_length=1, max_length=MAX_INPUTS)] | \
        Annotated[list[Ids], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None                  # metadata only
    # beyond OpenAI's API
    pooling: Literal["model", "last", "mean", "cls"] = "model"
    normalize: bool | None = None            # None: as the model's config says (else False)

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]  # type: ignore[list-item]
        return list(x)  # type: ignore[arg-type]

    def check_dimensions(self, size: int | None) -> None:
        """Vectors are never shortened (no Matryoshka truncation): ``dimensions`` may only be
        the model's own size."""
        if self.dimensions is not None and self.dimensions != size:
            raise P.ApiError(400, f"dimensions: this model's embeddings have {size} dimensions and are "
                                  f"not truncated (got {self.dimensions})", "dimensions",
                             code="unsupported_parameter")


def _rejected(exc: RequestRejected, index: int | None = None) -> P.ApiError:
    where = "" if index is None else f"input[{index}]: "
    return P.ApiError(400, where + str(exc), exc.param or "model", code="input_rejected")


async def _prepared(server: ServerState, inputs: list[str | list[int]]) -> list:
    """Each input tokenised and checked off the engine's thread (a 400 naming the one refused)."""
    prepare = server.loop.prepare_embedding  # type: ignore[attr-defined]
    prepared = []
    for i, x in enumerate(inputs):
        try:
            prepared.append(await prepare(x))
        except RequestRejected as exc:
            raise _rejected(exc, i if len(inputs) > 1 else None) from None
    return prepared


def _vector(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 bytes."""
    if encoding == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def _reply(server: ServerState, body: EmbeddingRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _vector(o.embedding or [], body.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "data": data, "model": server.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    server = state_of(request)
    if server.adapter_of(body.model) is not None:
        raise P.ApiError(400, f"embeddings come from the base model ({server.model_name!r}), not an adapter",
                         "model", code="unsupported_parameter")
    if not hasattr(server.loop, "submit_embedding"):       # engines on Ray: not yet
        raise P.ApiError(400, "embeddings are not served by this deployment", "model",
                         code="unsupported_endpoint")
    body.check_dimensions(server.hidden_size)
    try:
        pooling = PoolingParams(body.pooling, body.normalize)
    except RequestRejected as exc:
        raise _rejected(exc) from None
    prepared = await _prepared(server, body.inputs())
    submit = server.loop.submit_embedding  # type: ignore[attr-defined]
    handles = await started(request, [partial(submit, p, pooling) for p in prepared], _rejected)
    return JSONResponse(_reply(server, body, await collect(request, handles)))
