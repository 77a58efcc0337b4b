"""The Responses API routes: ``POST /v1/responses`` (JSON or Server-Sent Events), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``; thin wrappers over ``services.responses``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import UnsupportedParameterError
from ..http_headers import header_values
from ..protocol.responses import ResponseCreateRequest, ResponseDeleted, ResponseObject
from ..protocol.responses_items import InputItemList
from ..services.inference import responses as service
from ..services.inference.context import Call, StreamResult
from ..services.inference.registry import SERVICES
from .common import batch_invariant, json_body, lease_header, state, strict_mode, to_response
from .openapi import INFERENCE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()


def _sse(result: StreamResult) -> StreamingResponse:
    """OpenAI's Responses stream: each event as ``event: <type>`` and ``data: <json>`` lines (no ``[DONE]``)."""

    async def lines() -> AsyncIterator[str]:
        async for payload in result.events:
            yield f"event: {json.loads(payload)['type']}\ndata: {payload}\n\n"

    return StreamingResponse(
        lines(), media_type="text/event-stream", headers={**header_values(result.headers), "Cache-Control": "no-cache"}
    )


@router.post("/v1/responses")
@documented(
    body=ResponseCreateRequest,
    ok=ResponseObject,
    stream=True,
    errors=INFERENCE_ERRORS,
    headers=("strict", "lease", "invariant"),
)
async def create_response(request: Request) -> Response:
    """Create a Response (``stream: true``: as Server-Sent Events)."""
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request), invariant=batch_invariant(request))
    result = await SERVICES["/v1/responses"].create(state(request).ctx, body, call)
    return _sse(result) if isinstance(result, StreamResult) else to_response(result)


@router.get("/v1/responses/{response_id}")
@documented(ok=ResponseObject, errors=LOOKUP_ERRORS)
async def retrieve_response(request: Request, response_id: str) -> JSONResponse:
    """A stored Response. Replaying a stored Response as a stream (``stream=true``) is refused."""
    if request.query_params.get("stream", "").lower() == "true":
        raise UnsupportedParameterError(
            "Unsupported parameter: 'stream': a stored Response is returned as JSON only.", param="stream"
        )
    return JSONResponse(await service.retrieve(state(request).ctx, response_id))


@router.get("/v1/responses/{response_id}/input_items")
@documented(ok=InputItemList, errors=LOOKUP_ERRORS)
async def list_input_items(
    request: Request, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
) -> JSONResponse:
    """The items that went into a stored Response (the conversation it continued included), newest first unless
    ``order=asc``; ``include`` is refused (a stored item here has nothing more to include)."""
    if request.query_params.getlist("include") or request.query_params.getlist("include[]"):
        raise UnsupportedParameterError(
            "Unsupported parameter: 'include': an input item here has no extra data to include.", param="include"
        )
    page = await service.input_items(state(request).ctx, response_id, limit=limit, order=order, after=after)
    return JSONResponse(page)


@router.delete("/v1/responses/{response_id}")
@documented(ok=ResponseDeleted, errors=LOOKUP_ERRORS)
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    """Delete a stored Response."""
    return JSONResponse(await service.delete(state(request).ctx, response_id))
