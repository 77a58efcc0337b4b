"""Which service serves which endpoint: the table both ``api/`` and ``batches/`` read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from . import chat, completions
from .context import Call, ServiceContext, ServiceResult, StreamResult


@dataclass(frozen=True)
class EndpointService:
    """``check`` validates a body without running it; ``create`` runs it (the synchronous route's code)."""

    check: Callable[..., tuple[Any, Any]]
    create: Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]


SERVICES: dict[str, EndpointService] = {
    "/v1/chat/completions": EndpointService(chat.check, chat.create),
    "/v1/completions": EndpointService(completions.check, completions.create),
}
