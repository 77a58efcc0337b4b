"""The accounts ledger in the store (issue 13), on SQLite and PostgreSQL: a usage line is unique per batch line and per
request id (a second record charges nothing), credits and charges recompute to the stored balance, revoke and top-up
are guarded statements, the rollups group by day, model and key, and a key's queue use counts its unfinished
batches."""

from __future__ import annotations

import pytest

from miserver.store import Store
from miserver.store import batches as store_batches
from miserver.store import keys as store_keys
from miserver.store import usage as store_usage
from miserver.store.usage import Usage

DAY = 1_796_083_200  # 2026-12-01 00:00 UTC


async def _key(store: Store, key_id: str, balance: int | None) -> None:
    async with store.tx() as conn:
        await store_keys.insert_key(
            conn,
            key_id=key_id,
            name=key_id,
            digest=key_id * 2,
            prefix="sk-" + key_id,
            admin=False,
            balance=balance,
            max_pending_batches=None,
            max_enqueued_tokens=None,
            created_at=DAY,
        )


def _row(key_id: str, line: int, cost: int, *, model: str = "m", at: int = DAY) -> Usage:
    return Usage(key_id, model, "batch", "/v1/chat/completions", 10, 2, cost, at, batch_id="batch_1", line=line)


async def test_a_line_is_charged_once_and_the_ledger_recomputes(store: Store) -> None:
    await _key(store, "key_a", 100)
    async with store.tx() as conn:
        assert await store_usage.record_usage(conn, _row("key_a", 1, 30))
        assert not await store_usage.record_usage(conn, _row("key_a", 1, 30))  # the same batch line again
        realtime = Usage("key_a", "m", "realtime", "/v1/chat/completions", 5, 1, 7, DAY + 86_400, request_id="req_1")
        assert await store_usage.record_usage(conn, realtime)
        assert not await store_usage.record_usage(conn, realtime)  # the same request id again
        assert await store_usage.record_usage(conn, _row("key_a", 2, 80, model="n"))
    async with store.tx() as conn:
        assert await store_usage.balance_of(conn, "key_a") == 100 - 30 - 7 - 80
        ledger = await store_keys.ledger(conn, "key_a")
        assert (ledger.credits, ledger.charges, ledger.records, ledger.consistent) == (100, 117, 3, True)
        assert await store_usage.batch_charges(conn, "batch_1") == (2, 110)
        by_day = await store_usage.rollup(conn, group_by="day")
        assert [(r["day"], r["requests"], r["cost"]) for r in by_day] == [("2026-12-01", 2, 110), ("2026-12-02", 1, 7)]
        by_model = await store_usage.rollup(conn, group_by="model", kind="batch", start="2026-12-01", end="2026-12-01")
        assert [(r["model"], r["cost"]) for r in by_model] == [("m", 30), ("n", 80)]
        assert (await store_usage.rollup(conn, group_by="key", key_id="key_b")) == []


async def test_top_up_and_revoke_are_guarded(store: Store) -> None:
    await _key(store, "key_a", 0)
    await _key(store, "key_u", None)
    async with store.tx() as conn:
        assert (await store_keys.top_up(conn, "key_a", 50, DAY)).balance == 50
        with pytest.raises(store_keys.KeyNotFound):
            await store_keys.top_up(conn, "key_u", 50, DAY)  # an unlimited key has no balance to top up
        assert (await store_keys.revoke(conn, "key_a", DAY + 1)).revoked_at == DAY + 1
    async with store.tx() as conn:
        with pytest.raises(store_keys.KeyNotFound):
            await store_keys.revoke(conn, "key_a", DAY + 2)
        with pytest.raises(store_keys.KeyNotFound):
            await store_keys.top_up(conn, "key_a", 5, DAY)
        ledger = await store_keys.ledger(conn, "key_a")
        assert ledger.credits == 50 and ledger.consistent
        assert await store_keys.any_key(conn)


async def test_queue_use_counts_unfinished_batches(store: Store) -> None:
    await _key(store, "key_a", None)
    async with store.tx() as conn:
        for n in range(3):
            await store_batches.insert_batch(
                conn,
                batch_id=f"batch_{n}",
                endpoint="/v1/chat/completions",
                input_file_id="file-x",
                completion_window="24h",
                created_at=DAY,
                expires_at=DAY + 86_400,
                metadata=None,
                pack=False,
                output_expires_seconds=None,
                owner_key_id="key_a",
            )
        await store_batches.set_fields(conn, "batch_0", ("validating",), enqueued_tokens=40)
        await store_batches.set_fields(conn, "batch_1", ("validating",), enqueued_tokens=2)
        await store_batches.transition(conn, "batch_2", ("validating",), "failed", DAY)
        use = await store_keys.queue_use(conn, "key_a")
        assert (use.pending_batches, use.enqueued_tokens) == (2, 42)
        page, _ = await store_batches.list_batches(conn, limit=10, after=None, owner="key_b")
        assert page == []


async def test_authentication_asks_the_database_once_per_request(store: Store) -> None:
    """One statement per authenticated request: "any key?" while the process has seen none (a keyless server asks
    nothing else), then only the presented key's digest (keys are never deleted, so once seen they stay). Before, every
    request without a known key asked both."""
    from sqlalchemy import event

    from miserver.errors import AuthenticationError
    from miserver.services.accounts import keys as accounts

    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement)

    event.listen(store.engine.sync_engine, "before_cursor_execute", count)
    try:
        assert await accounts.principal_for(store, "sk-anything") is accounts.SYSTEM  # a keyless server is open
        assert len(statements) == 1 and not store.keys_exist
        record, key = await accounts.create_key(store, accounts.KeySpec.parse({"name": "a"}))
        statements.clear()
        with pytest.raises(AuthenticationError):
            await accounts.principal_for(store, None)  # keys exist now (seen at once): no key is refused
        assert store.keys_exist
        statements.clear()
        assert (await accounts.principal_for(store, key)).key_id == record.id
        assert len(statements) == 1
        statements.clear()
        with pytest.raises(AuthenticationError):
            await accounts.principal_for(store, "sk-wrong")
        assert len(statements) == 1
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", count)
