"""Lease routes (DESIGN §3.5): take, renew and release the resident model's lease; hand a lease to a batch."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from ..errors import ConflictError, InvalidRequestError, NotFoundError
from ..protocol.batches import BATCH_STATUSES, TERMINAL
from ..protocol.common import RequestModel, parse_request
from ..store import batches as store_batches
from .batches import batch_object
from .common import json_body, state, strict_mode

router = APIRouter()


class LeaseRequest(RequestModel):
    holder: str = Field(min_length=1, max_length=200)
    ttl_seconds: float = 60.0


class RenewRequest(RequestModel):
    ttl_seconds: float | None = None


@router.get("/api/lease")
async def current_lease(request: Request) -> dict[str, Any]:
    """The live lease, or ``{"lease": null}``."""
    live = state(request).ctx.leases.current()
    return live.as_json() if live else {"lease": None, "holder": None, "expires_at": None}


@router.post("/api/lease")
async def take_lease(request: Request) -> dict[str, Any]:
    """``{holder, ttl_seconds}`` -> ``{lease, holder, expires_at}``; 409 ``lease_held`` while another holder has it."""
    req = parse_request(LeaseRequest, await json_body(request), strict=strict_mode(request))
    return state(request).ctx.leases.acquire(req.holder, req.ttl_seconds).as_json()


@router.post("/api/lease/{lease}/renew")
async def renew_lease(lease: str, request: Request) -> dict[str, Any]:
    raw = await request.body()
    req = parse_request(RenewRequest, await json_body(request) if raw.strip() else {}, strict=strict_mode(request))
    return state(request).ctx.leases.renew(lease, req.ttl_seconds).as_json()


@router.post("/api/lease/{lease}/release")
@router.delete("/api/lease/{lease}")
async def release_lease(lease: str, request: Request) -> dict[str, Any]:
    state(request).ctx.leases.release(lease)
    return {"lease": lease, "released": True}


@router.post("/v1/batches/{batch_id}/lease")
async def hand_lease(batch_id: str, request: Request) -> dict[str, Any]:
    """Hand the caller's live lease (``X-miLLM-Lease``) to a batch that has not finished: it runs under it."""
    st = state(request)
    lease = request.headers.get("x-millm-lease")
    if not lease:
        raise InvalidRequestError("Send your live lease in the X-miLLM-Lease header.", param="X-miLLM-Lease")
    st.ctx.leases.get(lease)  # 404 unless it is the live lease
    async with st.store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id)
        if batch is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        live = tuple(sorted(set(BATCH_STATUSES) - TERMINAL))
        try:
            await store_batches.set_fields(conn, batch_id, live, caller_lease=lease)
        except store_batches.StaleStatus:  # finished (now, or between the read above and this write)
            raise ConflictError(f"The batch is {batch.status}.", param="batch_id", code="batch_finished") from None
        batch = await store_batches.get_batch(conn, batch_id)
    st.runner.wake()
    assert batch is not None
    return batch_object(batch)
