"""Stored Responses (``store: true`` on ``POST /v1/responses``): insert, get, delete, and prune the expired.

A stored Response is the object as returned plus the conversation turns that ``previous_response_id`` continues.
A Response past its ``expires_at`` is gone for every reader, pruned or not. Each function takes an open connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from .schema import responses


@dataclass(frozen=True)
class StoredResponse:
    """A Response as stored: ``body`` the Response object, ``turns`` the conversation up to and including its
    answer (``[{"role", "content"}]``, instructions excluded: they are not carried over); times in Unix seconds."""

    id: str
    model: str
    created_at: int
    expires_at: int
    body: dict[str, Any]
    turns: list[dict[str, str]]
    #: the API key that made it (None: made with no keys in the database)
    owner_key_id: str | None = None


async def insert_response(conn: AsyncConnection, record: StoredResponse) -> None:
    """Insert ``record`` (its id is new: ids are random)."""
    await conn.execute(
        insert(responses).values(
            id=record.id,
            model=record.model,
            created_at=record.created_at,
            expires_at=record.expires_at,
            body_json=json.dumps(record.body),
            turns_json=json.dumps(record.turns),
            owner_key_id=record.owner_key_id,
        )
    )


async def get_response(conn: AsyncConnection, response_id: str, *, now: int) -> StoredResponse | None:
    """The stored Response ``response_id``; None when there is none or it expired (``expires_at <= now``)."""
    row = (
        await conn.execute(select(responses).where(responses.c.id == response_id, responses.c.expires_at > now))
    ).first()
    if row is None:
        return None
    m = row._mapping
    return StoredResponse(
        id=m["id"],
        model=m["model"],
        created_at=m["created_at"],
        expires_at=m["expires_at"],
        body=json.loads(m["body_json"]),
        turns=json.loads(m["turns_json"]),
        owner_key_id=m["owner_key_id"],
    )


async def delete_response(conn: AsyncConnection, response_id: str, *, now: int, owner: str | None = None) -> bool:
    """Delete the live Response ``response_id`` of ``owner`` (None: any owner's); False when there was none (or it
    had expired, or it is another owner's)."""
    cond = [responses.c.id == response_id, responses.c.expires_at > now]
    if owner is not None:
        cond.append(responses.c.owner_key_id == owner)
    result = await conn.execute(delete(responses).where(*cond))
    return bool(result.rowcount)


async def prune_expired(conn: AsyncConnection, *, now: int) -> int:
    """Delete every Response whose ``expires_at`` has passed; returns how many."""
    result = await conn.execute(delete(responses).where(responses.c.expires_at <= now))
    return int(result.rowcount or 0)
