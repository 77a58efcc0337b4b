"""Batches API (DESIGN §3.2): create, list, retrieve, cancel."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from fastapi import APIRouter, Request

from ..batches import states
from ..errors import ConflictError, InvalidRequestError, NotFoundError
from ..ids import now, ordered_id
from ..protocol.batches import (
    BATCH_ENDPOINTS,
    Batch,
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchExtension,
    BatchUsage,
    RequestCounts,
)
from ..protocol.common import parse_request
from ..store import batches as store_batches
from ..store import idempotency
from ..store import files as store_files
from ..store.batches import BatchRecord
from .common import json_body, list_object, state, strict_mode
from .idempotency import idempotency_key, key_in_flight, replay

router = APIRouter()

#: Endpoints of DESIGN §3.2 that a later release will accept.
PLANNED_ENDPOINTS = ("/v1/responses", "/anthropic/v1/messages")
WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")


def batch_object(b: BatchRecord) -> dict[str, Any]:
    """The OpenAI Batch object plus miServer's ``millm`` block."""
    errors = BatchErrors(data=[BatchError(**e) for e in b.errors]) if b.errors else None
    return Batch(
        id=b.id,
        endpoint=b.endpoint,
        model=b.model,
        errors=errors,
        input_file_id=b.input_file_id,
        completion_window=b.completion_window,
        status=b.status,  # type: ignore[arg-type]
        output_file_id=b.output_file_id,
        error_file_id=b.error_file_id,
        created_at=b.created_at,
        in_progress_at=b.in_progress_at,
        expires_at=b.expires_at,
        finalizing_at=b.finalizing_at,
        completed_at=b.completed_at,
        failed_at=b.failed_at,
        expired_at=b.expired_at,
        cancelling_at=b.cancelling_at,
        cancelled_at=b.cancelled_at,
        request_counts=RequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        metadata=b.metadata,
        usage=BatchUsage(
            input_tokens=b.input_tokens, output_tokens=b.output_tokens, total_tokens=b.input_tokens + b.output_tokens
        ),
        millm=BatchExtension(
            pack=b.pack,
            waiting_reason=b.waiting_reason if b.status == "in_progress" else None,  # type: ignore[arg-type]
            lease_holder=b.lease_holder,
            description=(b.metadata or {}).get("description"),
        ),
    ).model_dump()


def window_hours(window: str, max_hours: int) -> int:
    """``"24h"`` -> 24. Raises 400 (param ``completion_window``) outside ``1h``..``max_hours``h or malformed."""
    m = WINDOW.match(window)
    hours = int(m.group(1)) if m else 0
    if not m or not 1 <= hours <= max_hours:
        raise InvalidRequestError(
            f"Invalid 'completion_window': {window!r}. Use whole hours from '1h' to '{max_hours}h' (e.g. '24h').",
            param="completion_window",
        )
    return hours


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise InvalidRequestError("Invalid 'metadata': at most 16 key-value pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise InvalidRequestError(f"Invalid 'metadata': key {key[:20]!r}... is over 64 characters.", param="metadata")
        if len(value) > 512:
            raise InvalidRequestError(f"Invalid 'metadata': the value of {key!r} is over 512 characters.", param="metadata")


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    st = state(request)
    key = idempotency_key(request)
    raw = await request.body()
    body_sha256 = hashlib.sha256(raw + b"\0" + request.headers.get("x-millm-lease", "").encode()).hexdigest()
    if key is not None:
        async with st.store.tx() as conn:
            first = replay(await idempotency.lookup(conn, "batches", key), body_sha256)
        if first is not None:
            return first
    req = parse_request(BatchCreateRequest, await json_body(request), strict=strict_mode(request))
    if req.endpoint not in BATCH_ENDPOINTS:
        hint = " It is not supported yet." if req.endpoint in PLANNED_ENDPOINTS else ""
        raise InvalidRequestError(
            f"Invalid 'endpoint': {req.endpoint!r}.{hint} Supported: {', '.join(BATCH_ENDPOINTS)}.", param="endpoint"
        )
    hours = window_hours(req.completion_window, st.settings.max_completion_window_hours())
    _check_metadata(req.metadata)
    created = now()
    async with st.store.tx() as conn:
        record = await store_files.get_file(conn, req.input_file_id)
        if record is None:
            raise InvalidRequestError(f"No file with id {req.input_file_id!r}.", param="input_file_id")
        if record.purpose != "batch":
            raise InvalidRequestError(
                f"The file {req.input_file_id} has purpose {record.purpose!r}; a batch needs purpose 'batch'.",
                param="input_file_id",
            )
        if record.content_deleted_at is not None or (record.expires_at is not None and record.expires_at <= created):
            raise InvalidRequestError(f"The file {req.input_file_id} has expired.", param="input_file_id")
        batch = await store_batches.insert_batch(
            conn,
            batch_id=ordered_id("batch_"),
            endpoint=req.endpoint,
            input_file_id=req.input_file_id,
            completion_window=req.completion_window,
            created_at=created,
            expires_at=created + hours * 3600,
            metadata=req.metadata,
            pack=st.settings.batch_pack_default if req.pack is None else req.pack,
            output_expires_seconds=req.output_expires_after.seconds if req.output_expires_after else None,
            caller_lease=request.headers.get("x-millm-lease"),
        )
        answer = batch_object(batch)
        if key is not None:
            try:
                await idempotency.remember(conn, "batches", key, body_sha256, 200, answer, created)
            except idempotency.KeyTaken:
                raise key_in_flight(key) from None
    st.runner.wake()
    return answer


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise InvalidRequestError("Invalid 'limit': must be between 1 and 100.", param="limit")
    async with state(request).store.tx() as conn:
        if after is not None and await store_batches.get_batch(conn, after) is None:
            raise InvalidRequestError(f"Invalid 'after': no batch with id {after!r}.", param="after")
        page, has_more = await store_batches.list_batches(conn, limit=limit, after=after)
    data = [batch_object(b) for b in page]
    return list_object(data, has_more)


async def _get(request: Request, batch_id: str) -> BatchRecord:
    async with state(request).store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id)
    if batch is None:
        raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    return batch_object(await _get(request, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    st = state(request)
    async with st.store.tx() as conn:
        await store_batches.transition(conn, batch_id, states.CANCELLABLE, "cancelling", now())
        batch = await store_batches.get_batch(conn, batch_id)
    if batch is None:
        raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
    if batch.status not in ("cancelling", "cancelled"):
        raise ConflictError(
            f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id", code="batch_not_cancellable"
        )
    st.runner.wake()
    return batch_object(batch)
