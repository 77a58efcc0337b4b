"""Accounts routes: API keys (admin only), usage rollups, the caller's own key, and a batch input file's
cost estimate. Thin wrappers over ``services/accounts/`` and ``services/batch_api/estimates.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..protocol.accounts import (
    Account,
    AnonymousAccount,
    CostEstimate,
    KeyCreateRequest,
    KeyList,
    KeyObject,
    TopUpRequest,
    UsageRollup,
)
from ..services.accounts import keys as accounts
from ..services.accounts.keys import KeySpec, key_object, require_admin
from ..services.accounts.prices import PriceTable
from ..services.accounts.rollups import usage_rollup
from ..services.batch_api.estimates import estimate_file_cost
from .common import json_body, state
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)])


@admin.post("/api/keys")
@documented(body=KeyCreateRequest, ok=KeyObject)
async def create_key(request: Request) -> dict[str, Any]:
    """``{name, admin, balance, max_pending_batches, max_enqueued_tokens}`` -> the key object with ``key`` (shown
    this once)."""
    record, key = await accounts.create_key(state(request).store, KeySpec.parse(await json_body(request)))
    return key_object(record, key)


@admin.get("/api/keys")
@documented(ok=KeyList)
async def list_keys(request: Request) -> dict[str, Any]:
    """Every key (never the key itself), oldest first."""
    records = await accounts.list_keys(state(request).store)
    return {"object": "list", "data": [key_object(r) for r in records]}


@admin.get("/api/keys/{key_id}")
@documented(ok=KeyObject, errors=LOOKUP_ERRORS)
async def get_key(key_id: str, request: Request) -> dict[str, Any]:
    """One key's object."""
    return key_object(await accounts.get_key(state(request).store, key_id))


@admin.post("/api/keys/{key_id}/revoke")
@documented(ok=KeyObject, errors=CHANGE_ERRORS)
async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
    """Revoke a key: 401 for it from now on; its running batches end ``failed`` (``key_revoked``)."""
    record = await accounts.revoke_key(state(request).store, key_id)
    state(request).runner.wake()
    return key_object(record)


@admin.post("/api/keys/{key_id}/top_up")
@documented(body=TopUpRequest, ok=KeyObject, errors=LOOKUP_ERRORS)
async def top_up(key_id: str, request: Request) -> dict[str, Any]:
    """``{amount}`` micro-units onto the key's balance; a batch waiting for a top-up goes on."""
    record = await accounts.top_up(state(request).store, key_id, await json_body(request))
    state(request).runner.wake()
    return key_object(record)


router.include_router(admin)


@router.get("/api/account")
@documented(ok=Account)
async def account(request: Request) -> dict[str, Any]:
    """The calling key's object (its balance and quotas); ``{"id": null, ...}`` on a server without keys."""
    principal = accounts.current()
    if principal.key_id is None:
        return AnonymousAccount(name=principal.name).model_dump()
    return key_object(await accounts.get_key(state(request).store, principal.key_id))


@router.get("/api/usage")
@documented(ok=UsageRollup, errors=LOOKUP_ERRORS)
async def usage(
    request: Request,
    start: str | None = None,
    end: str | None = None,
    key: str | None = None,
    model: str | None = None,
    kind: str | None = None,
    group_by: str = "day",
) -> dict[str, Any]:
    """Usage summed per ``group_by`` (``day``, ``model`` or ``key``) from day ``start`` to day ``end`` (UTC,
    ``YYYY-MM-DD``), filtered by ``key``, ``model``, ``kind``; a key reads its own usage, an admin anyone's."""
    st = state(request)
    prices = st.ctx.prices or PriceTable()
    return await usage_rollup(
        st.store,
        group_by=group_by,
        start=start,
        end=end,
        key=key,
        model=model,
        kind=kind,
        currency=prices.currency,
    )


@router.get("/v1/files/{file_id}/cost_estimate")
@documented(ok=CostEstimate, errors=(400, 404, 500, 503))
async def cost_estimate(file_id: str, request: Request, endpoint: str = "/v1/chat/completions") -> dict[str, Any]:
    """Rows, input tokens and the estimated batch cost of a batch input file at the current prices (extension);
    output tokens are bounded by each row's ``max_tokens``, so the cost is an upper bound."""
    st = state(request)
    return await estimate_file_cost(st.store, st.ctx, file_id, endpoint)
