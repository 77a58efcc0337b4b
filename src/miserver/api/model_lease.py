"""Lease routes (DESIGN §3.5): take, renew and release the resident model's lease; hand a lease to a batch."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import InvalidRequestError
from ..model_lease import BATCH_HOLDER_PREFIX
from ..protocol.batches import Batch
from ..protocol.parsing import parse_request
from ..protocol.server import LeaseObject, LeaseReleased, LeaseRequest, RenewRequest
from ..services.accounts import keys as accounts
from ..services.batch_api import batches as batches_service
from ..services.inference.checks import decode_json
from .common import bounded_body, json_body, lease_header, state, strict_mode
from .openapi import CHANGE_ERRORS, documented

router = APIRouter()


@router.get("/api/lease")
@documented(ok=LeaseObject)
async def current_lease(request: Request) -> dict[str, Any]:
    """The live lease, or ``{"lease": null}``. Its token is shown to admin keys only (accounts): another key
    sees the holder and the expiry, never the token that would let it renew or release another's lease."""
    live = state(request).ctx.leases.current()
    return accounts.shown_lease(live) if live else {"lease": None, "holder": None, "expires_at": None}


@router.post("/api/lease")
@documented(body=LeaseRequest, ok=LeaseObject, errors=(400, 409, 500), headers=("strict",))
async def take_lease(request: Request) -> dict[str, Any]:
    """``{holder, ttl_seconds}`` -> ``{lease, holder, expires_at}``; 409 ``lease_held`` while another holder has it."""
    req = parse_request(LeaseRequest, await json_body(request), strict=strict_mode(request))
    if req.holder.startswith(BATCH_HOLDER_PREFIX):
        raise InvalidRequestError(
            f"Invalid 'holder': names starting with {BATCH_HOLDER_PREFIX!r} are the batches' own.", param="holder"
        )
    return state(request).ctx.leases.acquire(req.holder, req.ttl_seconds, accounts.current().owner).as_json()


@router.post("/api/lease/{lease}/renew")
@documented(body=RenewRequest, body_required=False, ok=LeaseObject, errors=CHANGE_ERRORS, headers=("strict",))
async def renew_lease(lease: str, request: Request) -> dict[str, Any]:
    raw = await bounded_body(request)
    req = parse_request(RenewRequest, decode_json(raw) if raw.strip() else {}, strict=strict_mode(request))
    return state(request).ctx.leases.renew(lease, req.ttl_seconds).as_json()


@router.post("/api/lease/{lease}/release")
@router.delete("/api/lease/{lease}")
@documented(ok=LeaseReleased, errors=CHANGE_ERRORS)
async def release_lease(lease: str, request: Request) -> dict[str, Any]:
    state(request).ctx.leases.release(lease)
    return {"lease": lease, "released": True}


@router.post("/v1/batches/{batch_id}/lease")
@documented(ok=Batch, errors=CHANGE_ERRORS, headers=("lease",))
async def hand_lease(batch_id: str, request: Request) -> dict[str, Any]:
    """Hand the caller's live lease (``X-miLLM-Lease``) to a batch that has not finished: it runs under it."""
    st = state(request)
    lease = lease_header(request)
    if not lease:
        raise InvalidRequestError("Send your live lease in the X-miLLM-Lease header.", param="X-miLLM-Lease")
    st.ctx.leases.get(lease)  # 404 unless it is the live lease
    batch = await batches_service.hand_lease(st.store, batch_id, lease)
    st.runner.wake()
    return batch
