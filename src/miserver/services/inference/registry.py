"""Which service serves which endpoint: the table both ``api/`` and ``batches/`` read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import chat, completions, embeddings, messages, probes, responses, responses_rows
from .context import Call, ServiceContext, ServiceResult, StreamResult
from .many import Outcome, Plan, run_each
from .metering import billed
from .upstream_rows import routed_many


@dataclass(frozen=True)
class EndpointService:
    """One endpoint's service: ``check`` validates a body without running it; ``create`` runs it (the synchronous
    route's code); ``create_many`` runs many bodies (the batch runner's one call, see
    :func:`~miserver.services.inference.many.run_many`): with ``plan`` None each body as ``create`` computes it, with a
    planner the packable work in packs; rows naming an upstream model are routed once, here
    (``upstream_rows.routed_many``). ``packable`` says whether a planner changes anything
    (``pack: true``)."""

    check: Callable[..., tuple[Any, Any]]
    create: Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]  # usage recorded
    create_many: Callable[[ServiceContext, list[Any], Call, Plan | None], AsyncIterator[Outcome]]
    packable: bool


SERVICES: dict[str, EndpointService] = {
    "/v1/chat/completions": EndpointService(
        chat.check,
        billed("/v1/chat/completions", chat.create),
        routed_many("/v1/chat/completions", chat.parse, chat.create_many),
        True,
    ),
    "/v1/completions": EndpointService(
        completions.check,
        billed("/v1/completions", completions.create),
        routed_many("/v1/completions", completions.parse, completions.create_many),
        True,
    ),
    "/v1/embeddings": EndpointService(
        embeddings.check,
        billed("/v1/embeddings", embeddings.create),
        routed_many("/v1/embeddings", embeddings.parse, embeddings.create_many),
        True,
    ),
    "/api/probes/score": EndpointService(
        probes.check, billed("/api/probes/score", probes.create), partial(run_each, probes.create), False
    ),
    "/v1/responses": EndpointService(
        responses.check, billed("/v1/responses", responses.create), responses_rows.create_many, False
    ),
    "/anthropic/v1/messages": EndpointService(
        messages.check,
        billed("/anthropic/v1/messages", messages.create),
        routed_many("/anthropic/v1/messages", messages.parse, partial(run_each, messages.create), messages.RELAY),
        False,
    ),
}
