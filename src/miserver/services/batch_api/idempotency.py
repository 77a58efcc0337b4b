"""The ``Idempotency-Key`` rule of the creating routes (``POST /v1/files``, ``POST /v1/batches``), written once.

A request that carries a key is fingerprinted (SHA-256 of what makes it that request). The first answer under
``(route, key)`` is kept in the transaction that created the object, so a crash never leaves a key without its
object. A retry with the same fingerprint gets that first answer again, unchanged, without a second object; the same
key with another fingerprint is 409 ``idempotency_key_reused``; the loser of a race between two concurrent requests
with one key is 409 ``idempotency_key_in_flight`` (retrying it replays the winner's answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...clock import now
from ...errors import ConflictError, InvalidRequestError
from ...store import Store
from ...store import idempotency as store_idempotency

#: The longest ``Idempotency-Key`` accepted, in characters.
MAX_KEY_CHARS = 256

#: Creates the object inside the caller's transaction and returns its JSON answer; may raise :class:`APIError`.
Create = Callable[[AsyncConnection], Awaitable[dict[str, Any]]]


def check_key(key: str | None) -> str | None:
    """``key`` unchanged when it is absent or 1-256 characters; 400 ``invalid_value`` (param ``Idempotency-Key``)
    otherwise."""
    if key is not None and (not key or len(key) > MAX_KEY_CHARS):
        raise InvalidRequestError(f"Invalid 'Idempotency-Key': 1-{MAX_KEY_CHARS} characters.", param="Idempotency-Key")
    return key


@dataclass(frozen=True)
class Keyed:
    """One creating request: its route name (``"files"``, ``"batches"``), its ``Idempotency-Key`` (None when the
    request carries none) and its fingerprint (hex SHA-256 of what makes it that request)."""

    route: str
    key: str | None
    fingerprint: str


def replay(stored: store_idempotency.StoredAnswer | None, fingerprint: str) -> dict[str, Any] | None:
    """The first answer when ``stored`` was kept for the same fingerprint; None when nothing was kept.

    Raises 409 ``idempotency_key_reused`` when the key was used with another fingerprint.
    """
    if stored is None:
        return None
    if stored.body_sha256 != fingerprint:
        raise ConflictError(
            "This Idempotency-Key was used with a different request body.",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    return stored.response


def key_in_flight(key: str) -> ConflictError:
    """409 ``idempotency_key_in_flight`` for the loser of a race between two requests with the same key."""
    return ConflictError(
        f"A request with Idempotency-Key {key!r} is being processed; retry to get its answer.",
        param="Idempotency-Key",
        code="idempotency_key_in_flight",
    )


async def create_once(store: Store, request: Keyed, create: Create) -> dict[str, Any]:
    """Answer ``request``: the kept first answer for a retry, else ``create`` in one unit of work.

    Without a key this is just ``create`` in one transaction. With a key: a kept answer is replayed (before any
    check of the request, so a retry gets the first answer even if the world moved on, e.g. its input file expired);
    otherwise ``create(conn)`` runs and its answer (status 200) is kept under the key in the same transaction.
    Raises 409 ``idempotency_key_reused`` / ``idempotency_key_in_flight`` (see the module), and whatever
    :class:`~miserver.errors.APIError` ``create`` raises (then nothing is written).
    """
    if request.key is not None:
        async with store.tx() as conn:
            first = replay(await store_idempotency.lookup(conn, request.route, request.key), request.fingerprint)
        if first is not None:
            return first
    async with store.tx() as conn:
        answer = await create(conn)
        if request.key is not None:
            try:
                await store_idempotency.remember(
                    conn, request.route, request.key, request.fingerprint, 200, answer, now()
                )
            except store_idempotency.KeyTaken:
                raise key_in_flight(request.key) from None
    return answer
