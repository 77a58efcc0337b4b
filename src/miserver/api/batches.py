"""Batches API routes (DESIGN §3.2): create, list, retrieve, cancel. The rules are in
``services/batch_api/batches.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..protocol.batches import Batch, BatchCreateRequest, BatchList
from ..services.batch_api import batches as service
from ..services.batch_api.batches import batch_object
from .common import bounded_body, lease_header, list_object, state
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented

__all__ = ["batch_object", "router"]

router = APIRouter()


@router.post("/v1/batches")
@documented(body=BatchCreateRequest, ok=Batch, errors=(400, 404, 409, 500), headers=("lease", "idempotency"))
async def create_batch(request: Request) -> dict[str, Any]:
    """The new Batch in ``validating`` (or the first answer again for a retry under the same Idempotency-Key). The
    body is parsed strictly whatever ``X-miLLM-Strict`` says: an unknown field is 400 ``unknown_parameter``."""
    st = state(request)
    form = service.BatchCreate(
        raw=await bounded_body(request),
        caller_lease=lease_header(request),
        idempotency_key=request.headers.get("idempotency-key"),
    )
    answer = await service.create_batch(
        st.store,
        form,
        max_window_hours=st.settings.max_completion_window_hours(),
        pack_default=st.settings.batch_pack_default,
        prices=st.ctx.prices,
    )
    st.runner.wake()
    return answer


@router.get("/v1/batches")
@documented(ok=BatchList)
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    """The list envelope of Batch objects, newest first."""
    data, has_more = await service.list_batches(state(request).store, limit=limit, after=after)
    return list_object(data, has_more)


@router.get("/v1/batches/{batch_id}")
@documented(ok=Batch, errors=LOOKUP_ERRORS)
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """The Batch object."""
    return await service.retrieve_batch(state(request).store, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
@documented(ok=Batch, errors=CHANGE_ERRORS)
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """The batch, now ``cancelling`` (unchanged when already cancelling or cancelled); 409 once it has ended."""
    st = state(request)
    answer = await service.cancel_batch(st.store, batch_id)
    st.runner.wake()
    return answer
