"""Routes of batch operations: pause, resume, retry, delete and results of a batch (extensions of
``/v1/batches``), webhook endpoints (``/api/webhooks``) and ``/metrics``. The rules are in
``services/batch_api/operations.py``,
``services/batch_api/webhooks.py`` and ``metrics.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..metrics import Metrics
from ..protocol.batches import Batch
from ..protocol.operations import DeletedBatch, DeletedWebhook, WebhookList
from ..protocol.webhooks import WebhookCreateRequest, WebhookObject
from ..services.batch_api import operations as service
from ..services.batch_api import webhooks as webhooks_service
from .common import bounded_body, list_object, state
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented

router = APIRouter()


@router.post("/v1/batches/{batch_id}/pause")
@documented(ok=Batch, errors=CHANGE_ERRORS)
async def pause_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """The batch, paused (``millm.paused``; ``waiting_reason: paused`` while ``in_progress``); 409 once it ended."""
    st = state(request)
    answer = await service.pause(st.store, batch_id)
    st.runner.wake()
    return answer


@router.post("/v1/batches/{batch_id}/resume")
@documented(ok=Batch, errors=CHANGE_ERRORS)
async def resume_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """The batch, no longer paused; 409 once it ended."""
    st = state(request)
    answer = await service.resume(st.store, batch_id)
    st.runner.wake()
    return answer


@router.post("/v1/batches/{batch_id}/retry")
@documented(ok=Batch, errors=CHANGE_ERRORS)
async def retry_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """A new batch of the failed, cancelled and expired rows of an ended batch (``metadata.retry_of``)."""
    st = state(request)
    answer = await service.retry(
        st.store,
        batch_id,
        max_window_hours=st.settings.max_completion_window_hours(),
        pack_default=st.settings.batch_pack_default,
    )
    st.runner.wake()
    return answer


@router.delete("/v1/batches/{batch_id}")
@documented(ok=DeletedBatch, errors=CHANGE_ERRORS)
async def delete_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """``{id, object: "batch", deleted: true}`` for an ended batch (its rows go; its files stay); 409 before."""
    return await service.delete(state(request).store, batch_id)


@router.get("/v1/batches/{batch_id}/results")
@documented(ok_media="application/jsonl", errors=LOOKUP_ERRORS)
async def batch_results(
    batch_id: str,
    request: Request,
    offset: int = 0,
    limit: int = service.RESULTS_DEFAULT_LIMIT,
    status: str | None = None,
    custom_id: str | None = None,
) -> Response:
    """JSON Lines of the result lines recorded so far after input line ``offset``, in input order. Headers:
    ``X-Incomplete`` (``true`` while the batch may record more rows) and ``X-Last-Line`` (the next ``offset``)."""
    page = await service.results(
        state(request).store, batch_id, offset=offset, limit=limit, status=status, custom_id=custom_id
    )
    headers = {"X-Incomplete": "true" if page.incomplete else "false", "X-Last-Line": str(page.last_line)}
    return Response(page.body, media_type="application/jsonl", headers=headers)


@router.post("/api/webhooks")
@documented(body=WebhookCreateRequest, ok=WebhookObject)
async def create_webhook(request: Request) -> dict[str, Any]:
    """``{id, object, url, events, created_at, secret}``: the secret (``whsec_...``) is shown this once."""
    st = state(request)
    return await webhooks_service.create(
        st.store, await bounded_body(request), allow_private=st.settings.webhook_allow_private
    )


@router.get("/api/webhooks")
@documented(ok=WebhookList)
async def list_webhooks(request: Request) -> dict[str, Any]:
    """The registered endpoints (without their secrets), oldest first."""
    return list_object(await webhooks_service.list_all(state(request).store), False)


@router.delete("/api/webhooks/{webhook_id}")
@documented(ok=DeletedWebhook, errors=LOOKUP_ERRORS)
async def delete_webhook(webhook_id: str, request: Request) -> dict[str, Any]:
    """``{id, object, deleted: true}``; 404 when there is no such endpoint."""
    return await webhooks_service.delete(state(request).store, webhook_id)


@router.get("/metrics")
@documented(ok_media="text/plain")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (see :mod:`miserver.metrics` for the series)."""
    st = state(request)
    registry = request.app.state.metrics
    assert isinstance(registry, Metrics)
    return Response(await registry.render(st.store, st.ctx.gate, st.ctx.engine), media_type=CONTENT_TYPE_LATEST)
