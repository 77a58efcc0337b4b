"""Anthropic's routes under ``/anthropic``: Messages and Message Batches (thin wrappers over ``services``).

Errors here answer in Anthropic's envelope (the application's exception handlers pick it by path, see
:meth:`~miserver.errors.APIError.answer_for`). The ``x-api-key`` and ``anthropic-version`` headers that Anthropic's
clients send are accepted (this server has no keys; any version is answered in the one format it speaks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..services.context import Call, StreamResult
from ..services.registry import SERVICES
from .common import json_body, state, strict_mode

router = APIRouter()

MESSAGES = "/anthropic/v1/messages"


@router.post(MESSAGES)
async def create_message(request: Request) -> Response:
    """A Message, or its Server-Sent Events when ``stream`` is true."""
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=request.headers.get("x-millm-lease"))
    result = await SERVICES[MESSAGES].create(state(request).ctx, body, call)
    if isinstance(result, StreamResult):
        events = result.events

        async def sse() -> AsyncIterator[str]:
            async for frame in events:
                yield frame + "\n\n"

        headers = {**result.headers, "Cache-Control": "no-cache"}
        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)
    return JSONResponse(result.body, status_code=result.status_code, headers=result.headers)
