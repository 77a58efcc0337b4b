"""Which service serves which endpoint: the table both ``api/`` and ``batches/`` read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from . import chat, completions, embeddings, probes
from .context import Call, ServiceContext, ServiceResult, StreamResult
from .many import Outcome, Plan


@dataclass(frozen=True)
class EndpointService:
    """``check`` validates a body without running it; ``create`` runs it (the synchronous route's code).

    ``create_many``, on packable endpoints, runs many bodies at once (a ``pack: true`` batch): the packable work of
    all of them in the packs a planner makes, the rest one at a time through ``create``; it yields one
    :class:`~miserver.services.many.Outcome` per body, in no particular order.
    """

    check: Callable[..., tuple[Any, Any]]
    create: Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]
    create_many: Callable[[ServiceContext, list[Any], Call, Plan], AsyncIterator[Outcome]] | None = None


SERVICES: dict[str, EndpointService] = {
    "/v1/chat/completions": EndpointService(chat.check, chat.create, chat.create_many),
    "/v1/completions": EndpointService(completions.check, completions.create, completions.create_many),
    "/v1/embeddings": EndpointService(embeddings.check, embeddings.create, embeddings.create_many),
    "/api/probes/score": EndpointService(probes.check, probes.create),
}
