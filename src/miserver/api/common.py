"""Helpers shared by the routes: the typed application state, JSON bodies, service results as responses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import InvalidRequestError
from ..services.context import ServiceContext, ServiceResult, StreamResult
from ..settings import Settings
from ..store import Store


@dataclass
class AppState:
    """Everything the routes reach through ``request.app.state.miserver``."""

    settings: Settings
    store: Store
    ctx: ServiceContext
    runner: Any  # batches.runner.BatchRunner (typed loosely to keep api/ free of the runner's imports)
    residency: Any  # services.residency.Residency
    started_at: int = 0


def state(request: Request) -> AppState:
    return request.app.state.miserver  # type: ignore[no-any-return]


async def json_body(request: Request) -> Any:
    """The decoded JSON body; 400 ``invalid_json`` when it does not parse."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. Send valid JSON with Content-Type: application/json.",
            code="invalid_json",
        ) from None


def strict_mode(request: Request) -> bool:
    """``X-miLLM-Strict: true`` turns unknown fields into 400 ``unknown_parameter``."""
    return request.headers.get("x-millm-strict", "").strip().lower() in {"1", "true", "yes"}


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The OpenAI list envelope; ``has_more`` is never true on an empty page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more and bool(data),
    }


def to_response(result: ServiceResult | StreamResult) -> Response:
    """A service's result as an HTTP response (JSON, or Server-Sent Events for a stream)."""
    if isinstance(result, StreamResult):

        async def sse() -> Any:
            async for payload in result.events:
                yield f"data: {payload}\n\n"

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={**result.headers, "Cache-Control": "no-cache"}
        )
    return JSONResponse(result.body, status_code=result.status_code, headers=result.headers)
