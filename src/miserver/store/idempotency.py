"""Idempotency keys: the first answer to ``(route, Idempotency-Key)`` is kept and replayed for a retry.

A retry must carry the same body (compared by SHA-256); the same key with another body is a conflict. The key is
inserted in the same transaction as the object it created, so a crash never leaves a key without its object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import idempotency_keys


@dataclass(frozen=True)
class StoredAnswer:
    """The kept first answer under a key: the request's fingerprint (hex SHA-256), its status and JSON body."""

    body_sha256: str
    status_code: int
    response: dict[str, Any]


async def lookup(conn: AsyncConnection, route: str, key: str) -> StoredAnswer | None:
    """The answer kept under ``(route, key)``; None when the key was never used on that route."""
    row = (
        await conn.execute(
            select(idempotency_keys).where(idempotency_keys.c.route == route, idempotency_keys.c.key == key)
        )
    ).first()
    if row is None:
        return None
    return StoredAnswer(row.body_sha256, row.status_code, json.loads(row.response))


class KeyTaken(Exception):
    """A concurrent request with the same key stored its answer first."""


async def remember(
    conn: AsyncConnection, route: str, key: str, body_sha256: str, status_code: int, response: dict[str, Any], at: int
) -> None:
    """Keep the answer in the caller's transaction; :class:`KeyTaken` if a concurrent request won the race."""
    try:
        async with conn.begin_nested():
            await conn.execute(
                insert(idempotency_keys).values(
                    route=route,
                    key=key,
                    body_sha256=body_sha256,
                    status_code=status_code,
                    response=json.dumps(response),
                    created_at=at,
                )
            )
    except IntegrityError:
        raise KeyTaken(key) from None
