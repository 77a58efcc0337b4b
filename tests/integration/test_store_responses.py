"""Stored Responses in the store (``store/responses.py``), on SQLite and PostgreSQL: insert, get, delete, and expiry
(an expired Response is gone for every reader before it is pruned)."""

from __future__ import annotations

from miserver.store import Store
from miserver.store import responses as store_responses
from miserver.store.responses import StoredResponse


def record(response_id: str, created_at: int, expires_at: int) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        model="tiny",
        created_at=created_at,
        expires_at=expires_at,
        body={"id": response_id, "object": "response", "output": [], "text": "\u00e9t\u00e9"},
        turns=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    )


async def test_insert_get_delete_and_expiry(store: Store) -> None:
    async with store.tx() as conn:
        await store_responses.insert_response(conn, record("resp_live", 100, 1000))
        await store_responses.insert_response(conn, record("resp_old", 100, 500))
    async with store.read() as conn:
        live = await store_responses.get_response(conn, "resp_live", now=600)
        assert live == record("resp_live", 100, 1000)
        assert await store_responses.get_response(conn, "resp_old", now=600) is None, "expired: gone before pruning"
        assert await store_responses.get_response(conn, "resp_old", now=499) is not None
        assert await store_responses.get_response(conn, "resp_none", now=0) is None
    async with store.tx() as conn:
        assert not await store_responses.delete_response(conn, "resp_old", now=600), "an expired one is not deleted"
        assert await store_responses.prune_expired(conn, now=600) == 1
        assert await store_responses.get_response(conn, "resp_old", now=0) is None
        assert await store_responses.delete_response(conn, "resp_live", now=600)
        assert not await store_responses.delete_response(conn, "resp_live", now=600)
        assert await store_responses.prune_expired(conn, now=10_000) == 0
