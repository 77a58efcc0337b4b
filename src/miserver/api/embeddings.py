"""``POST /v1/embeddings`` on the resident model: a thin wrapper over ``services.embeddings``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..protocol.embeddings import CreateEmbeddingResponse, EmbeddingRequest
from ..services.inference.context import Call
from ..services.inference.registry import SERVICES
from .common import json_body, lease_header, state, strict_mode, to_response
from .openapi import INFERENCE_ERRORS, documented

router = APIRouter()


@router.post("/v1/embeddings")
@documented(body=EmbeddingRequest, ok=CreateEmbeddingResponse, errors=INFERENCE_ERRORS, headers=("strict", "lease"))
async def embeddings(request: Request) -> Response:
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request))
    return to_response(await SERVICES["/v1/embeddings"].create(state(request).ctx, body, call))
