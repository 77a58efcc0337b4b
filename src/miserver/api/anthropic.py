"""Anthropic's routes under ``/anthropic``: Messages and Message Batches (thin wrappers over ``services``).

Errors here answer in Anthropic's envelope (the application's exception handlers pick it by path, see
:meth:`~miserver.errors.APIError.answer_for`). The ``x-api-key`` and ``anthropic-version`` headers that Anthropic's
clients send are accepted: ``x-api-key`` is an API key here, as ``Authorization: Bearer`` is elsewhere (see
``services/accounts/keys.py``); any version is answered in the one format it speaks.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import NotFoundError
from ..http_headers import header_values
from ..protocol.anthropic import (
    CountTokensRequest,
    DeletedMessageBatch,
    Message,
    MessageBatch,
    MessageBatchCreateRequest,
    MessageBatchList,
    MessagesRequest,
    MessageTokensCount,
    ModelInfo,
    ModelInfoList,
)
from ..services.batch_api import message_batches
from ..services.inference import messages, routing
from ..services.inference.context import Call, ServiceContext, StreamResult
from ..services.inference.registry import SERVICES
from .common import batch_invariant, bounded_body, json_body, lease_header, state, strict_mode
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()

MESSAGES = "/anthropic/v1/messages"
BATCHES = "/anthropic/v1/messages/batches"


@router.post(MESSAGES)
@documented(
    body=MessagesRequest,
    ok=Message,
    stream=True,
    errors=(400, 404, 409, 500, 529),
    headers=("strict", "lease", "invariant"),
)
async def create_message(request: Request) -> Response:
    """A Message, or its Server-Sent Events when ``stream`` is true."""
    body = await json_body(request)
    call = Call(strict=strict_mode(request), lease=lease_header(request), invariant=batch_invariant(request))
    result = await SERVICES[MESSAGES].create(state(request).ctx, body, call)
    if isinstance(result, StreamResult):
        events = result.events

        async def sse() -> AsyncIterator[str]:
            async for frame in events:
                yield frame + "\n\n"

        headers = {**header_values(result.headers), "Cache-Control": "no-cache"}
        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)
    return JSONResponse(result.body, status_code=result.status_code, headers=header_values(result.headers))


@router.post(MESSAGES + "/count_tokens")
@documented(body=CountTokensRequest, ok=MessageTokensCount, errors=(400, 404, 500), headers=("strict",))
async def count_tokens(request: Request) -> dict[str, Any]:
    """The prompt's tokens as a Messages request would count them (nothing runs on the engine)."""
    body = await json_body(request)
    return messages.count_tokens(state(request).ctx, body, strict=strict_mode(request))


def _model_info(ctx: ServiceContext, model: dict[str, Any]) -> ModelInfo:
    created = datetime.datetime.fromtimestamp(int(model["created"]), tz=datetime.UTC)
    engine = ctx.engine
    resident = engine is not None and engine.info.model_id == model["id"]
    return ModelInfo(
        id=model["id"],
        display_name=model["id"],
        created_at=created.isoformat().replace("+00:00", "Z"),
        max_input_tokens=(engine.info.context_length or None) if resident and engine is not None else None,
    )


@router.get("/anthropic/v1/models")
@documented(ok=ModelInfoList)
async def list_models(request: Request) -> dict[str, Any]:
    """The served models in Anthropic's shape (the same models as ``GET /v1/models``), on one page."""
    st = state(request)
    data = [_model_info(st.ctx, m) for m in routing.list_models(st.ctx, st.started_at)]
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return ModelInfoList(data=data, has_more=False, first_id=first, last_id=last).model_dump()


@router.get("/anthropic/v1/models/{model_id:path}")
@documented(ok=ModelInfo, errors=LOOKUP_ERRORS)
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """One served model in Anthropic's shape; 404 ``not_found_error`` for a model this server does not serve."""
    st = state(request)
    found = next((m for m in routing.list_models(st.ctx, st.started_at) if m["id"] == model_id), None)
    if found is None:
        raise NotFoundError(f"model: {model_id}", param="model_id", code="model_not_found")
    return _model_info(st.ctx, found).model_dump()


# -- Message Batches: the same durable batches as /v1/batches (services/batch_api/message_batches.py) ------------------


@router.post(BATCHES)
@documented(body=MessageBatchCreateRequest, ok=MessageBatch, errors=(400, 409, 413, 500), headers=("lease",))
async def create_message_batch(request: Request) -> dict[str, Any]:
    """A new Message Batch (``in_progress``) over the inline ``requests``. The body is parsed strictly whatever
    ``X-miLLM-Strict`` says: an unknown field is 400 naming it."""
    st = state(request)
    answer = await message_batches.create(
        st.store,
        # inline requests: as large as a batch file may be
        await bounded_body(request, st.settings.batch_max_file_bytes, "BATCH_MAX_FILE_BYTES"),
        base_url=str(request.base_url),
        max_window_hours=st.settings.max_completion_window_hours(),
        pack_default=st.settings.batch_pack_default,
        file_expiry_seconds=st.settings.file_default_expiry_seconds,
        caller_lease=lease_header(request),
        prices=st.ctx.prices,
    )
    st.runner.wake()
    return answer


@router.get(BATCHES)
@documented(ok=MessageBatchList)
async def list_message_batches(
    request: Request, limit: int = 20, after_id: str | None = None, before_id: str | None = None
) -> dict[str, Any]:
    """A page of Message Batches, newest first."""
    return await message_batches.list_batches(
        state(request).store, limit=limit, after_id=after_id, before_id=before_id, base_url=str(request.base_url)
    )


@router.get(BATCHES + "/{message_batch_id}")
@documented(ok=MessageBatch, errors=LOOKUP_ERRORS)
async def retrieve_message_batch(message_batch_id: str, request: Request) -> dict[str, Any]:
    """The Message Batch."""
    return await message_batches.retrieve(state(request).store, message_batch_id, base_url=str(request.base_url))


@router.post(BATCHES + "/{message_batch_id}/cancel")
@documented(ok=MessageBatch, errors=CHANGE_ERRORS)
async def cancel_message_batch(message_batch_id: str, request: Request) -> dict[str, Any]:
    """The Message Batch, now ``canceling``."""
    st = state(request)
    answer = await message_batches.cancel(st.store, message_batch_id, base_url=str(request.base_url))
    st.runner.wake()
    return answer


@router.delete(BATCHES + "/{message_batch_id}")
@documented(ok=DeletedMessageBatch, errors=CHANGE_ERRORS)
async def delete_message_batch(message_batch_id: str, request: Request) -> dict[str, Any]:
    """``{id, type: "message_batch_deleted"}`` for an ended batch."""
    return await message_batches.delete(state(request).store, message_batch_id)


@router.get(BATCHES + "/{message_batch_id}/results")
@documented(ok_media="application/x-jsonl", errors=CHANGE_ERRORS)
async def message_batch_results(message_batch_id: str, request: Request) -> StreamingResponse:
    """The results as JSON Lines, streamed."""
    lines = await message_batches.results(state(request).store, message_batch_id)
    return StreamingResponse(lines, media_type="application/x-jsonl")
