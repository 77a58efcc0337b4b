"""``Idempotency-Key`` handling shared by ``POST /v1/files`` and ``POST /v1/batches``."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from ..errors import ConflictError, InvalidRequestError
from ..store import idempotency

MAX_KEY_CHARS = 256


def idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key`` header (400 when longer than 256 characters)."""
    key = request.headers.get("idempotency-key")
    if key is not None and (not key or len(key) > MAX_KEY_CHARS):
        raise InvalidRequestError(
            f"Invalid 'Idempotency-Key': 1-{MAX_KEY_CHARS} characters.", param="Idempotency-Key"
        )
    return key


def key_in_flight(key: str) -> ConflictError:
    """409 for the loser of a race between two requests with the same key (retry it to get the first answer)."""
    return ConflictError(
        f"A request with Idempotency-Key {key!r} is being processed; retry to get its answer.",
        param="Idempotency-Key",
        code="idempotency_key_in_flight",
    )


def replay(stored: idempotency.StoredAnswer | None, body_sha256: str) -> dict[str, Any] | None:
    """The first answer for a retry with the same body; 409 ``idempotency_key_reused`` for another body."""
    if stored is None:
        return None
    if stored.body_sha256 != body_sha256:
        raise ConflictError(
            "This Idempotency-Key was used with a different request body.",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    return stored.response
