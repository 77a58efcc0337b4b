"""Pydantic models of the webhooks API (``/api/webhooks``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .common import RequestModel, ResponseModel

MAX_URL_CHARS = 2048


class WebhookCreateRequest(RequestModel):
    """``POST /api/webhooks``: the destination URL (http or https) and the events it receives (at least one)."""

    url: str = Field(max_length=MAX_URL_CHARS)
    events: list[str] = Field(min_length=1)


class WebhookObject(ResponseModel):
    """A registered endpoint; ``secret`` only in the answer of its creation."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    created_at: int
    secret: str | None = None
