"""Pydantic models of the batch operations' answers: a deleted batch, the webhook endpoints' list and a
deleted endpoint (the create body and the endpoint object are in ``protocol/webhooks.py``)."""

from __future__ import annotations

from typing import Literal

from .common import ResponseModel
from .webhooks import WebhookObject


class DeletedBatch(ResponseModel):
    """``DELETE /v1/batches/{id}``: the batch and its rows are gone (its files stay)."""

    id: str
    object: Literal["batch"] = "batch"
    deleted: bool


class WebhookList(ResponseModel):
    """``GET /api/webhooks``: the caller's endpoints, oldest first, without their secrets."""

    object: Literal["list"] = "list"
    data: list[WebhookObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedWebhook(ResponseModel):
    """``DELETE /api/webhooks/{id}``."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool
