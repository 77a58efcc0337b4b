"""The store on SQLite and PostgreSQL: exactly-once recording, fencing, guarded transitions, chunked files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError

from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf
from miserver.store import rows as sr
from miserver.store.batches import StaleStatus


async def make_batch(store: Store, n_rows: int, batch_id: str = "batch_1", models: list[str] | None = None) -> None:
    """An ``in_progress`` batch of ``n_rows`` valid rows (line ``i + 1`` naming ``models[i]`` when given)."""
    async with store.tx() as conn:
        await sf.insert_file(
            conn,
            file_id="file-1",
            purpose="batch",
            filename="in.jsonl",
            created_at=1,
            expires_at=None,
            chunks=[b"x"],
            owner_key_id=None,
        )
        await sb.insert_batch(
            conn,
            batch_id=batch_id,
            endpoint="/v1/completions",
            input_file_id="file-1",
            completion_window="24h",
            created_at=1,
            expires_at=86401,
            metadata={"k": "v"},
            pack=False,
            output_expires_seconds=None,
        )
        named = models or [None] * n_rows
        rows = [
            {"line": i + 1, "custom_id": f"r{i}", "valid": True, "body": "{}", "model": m} for i, m in enumerate(named)
        ]
        await sr.insert_rows(conn, batch_id, rows)
        await sb.set_fields(conn, batch_id, ("validating",), total=n_rows)
        await sb.transition(conn, batch_id, ("validating",), "in_progress", 2)


async def claim(store: Store, token: str, limit: int = 3, now_ms: int = 1000, ttl_ms: int = 500) -> list[int]:
    async with store.tx() as conn:
        rows = await sr.claim(
            conn,
            batch_id="batch_1",
            limit=limit,
            worker="w",
            token=token,
            now_ms=now_ms,
            ttl_ms=ttl_ms,
            skip_locked=store.skip_locked,
        )
    return [r.line for r in rows]


async def record(store: Store, line: int, token: str) -> bool:
    async with store.tx() as conn:
        recorded = await sr.record_many(
            conn, batch_id="batch_1", token=token, results=[sr.RowResult(line, True, '{"ok": 1}', 3, 2)]
        )
    return recorded.lines == {line}


async def test_claims_are_disjoint_and_in_line_order(store: Store) -> None:
    await make_batch(store, 5)
    assert await claim(store, "t1") == [1, 2, 3]
    assert await claim(store, "t2") == [4, 5]
    assert await claim(store, "t3") == []


async def test_recorded_row_is_never_recorded_or_claimed_again(store: Store) -> None:
    await make_batch(store, 2)
    assert await claim(store, "t1", limit=1) == [1]
    assert await record(store, 1, "t1")
    assert not await record(store, 1, "t1")
    # even after the claim's deadline the recorded row is not claimable
    assert await claim(store, "t2", now_ms=10_000) == [2]
    async with store.tx() as conn:
        b = await sb.get_batch(conn, "batch_1")
    assert b is not None and (b.completed, b.failed, b.input_tokens, b.output_tokens) == (1, 0, 3, 2)


async def test_a_group_records_only_its_own_pending_rows_and_counts_them_once(store: Store) -> None:
    await make_batch(store, 5)
    assert await claim(store, "t1", limit=3) == [1, 2, 3]
    assert await record(store, 2, "t1")  # recorded before the group
    assert await claim(store, "t2", limit=2) == [4, 5]  # another worker's rows
    results = [
        sr.RowResult(1, True, '{"ok": 1}', 3, 2),
        sr.RowResult(2, True, '{"again": 1}', 7, 7),  # already recorded: left as it is, not counted
        sr.RowResult(3, False, '{"error": 1}', 0, 0),
        sr.RowResult(4, True, '{"not mine": 1}', 5, 5),  # claimed under t2: fenced off
    ]
    async with store.tx() as conn:
        await sb.set_fields(conn, "batch_1", ("in_progress",), paused_at=9)
        recorded = await sr.record_many(conn, batch_id="batch_1", token="t1", results=results)
        b = await sb.get_batch(conn, "batch_1")
    assert recorded == sr.Recorded(frozenset({1, 3}), "in_progress", True)
    assert b is not None and (b.completed, b.failed, b.input_tokens, b.output_tokens) == (2, 1, 6, 4)
    rows = {r.line: r for r in await stored_rows(store)}
    assert (rows[2].result, rows[4].state) == ('{"ok": 1}', "pending")
    # nothing recordable: no counter moves, and the run state is still read
    async with store.tx() as conn:
        await sb.transition(conn, "batch_1", ("in_progress",), "cancelling", 10)
        again = await sr.record_many(conn, batch_id="batch_1", token="t1", results=results[:1])
    assert again == sr.Recorded(frozenset(), "cancelling", True)


async def stored_rows(store: Store) -> list[sr.StoredRow]:
    async with store.read() as conn:
        return [r async for r in sr.iter_rows(conn, "batch_1")]


async def test_fencing_token_stops_a_worker_whose_claim_was_taken(store: Store) -> None:
    await make_batch(store, 1)
    assert await claim(store, "old", ttl_ms=100) == [1]
    assert await claim(store, "new", now_ms=5000) == [1]  # the old claim expired and was taken over
    assert not await record(store, 1, "old")
    assert await record(store, 1, "new")


async def test_released_claim_is_claimable_at_once(store: Store) -> None:
    await make_batch(store, 2)
    assert await claim(store, "t1") == [1, 2]
    async with store.tx() as conn:
        await sr.release_claim(conn, batch_id="batch_1", token="t1")
    assert await claim(store, "t2") == [1, 2]


async def test_claims_only_from_in_progress_batches(store: Store) -> None:
    await make_batch(store, 2)
    async with store.tx() as conn:
        await sb.transition(conn, "batch_1", ("in_progress",), "cancelling", 3)
    assert await claim(store, "t1") == []


async def test_concurrent_claims_never_overlap(store: Store) -> None:
    await make_batch(store, 40)
    results = await asyncio.gather(*(claim(store, f"t{i}", limit=4) for i in range(10)))
    lines = [line for r in results for line in r]
    assert sorted(lines) == list(range(1, 41))


async def test_a_claim_by_model_takes_the_rows_of_those_models_only(store: Store) -> None:
    """Gateway mode: the rows of a pool that is down wait while rows of live pools behind them are claimed (the
    filter is in the claim statement itself, with its lock clause on PostgreSQL); counts follow the same filter."""
    models = ["down", "down", "live", "down", "live", "other", "live"]
    await make_batch(store, len(models), models=models)
    async with store.tx() as conn:
        assert await sr.row_models(conn, "batch_1") == ["down", "live", "other"]
        assert await sr.count_pending(conn, "batch_1", models=["live"]) == 3
        assert await sr.count_pending(conn, "batch_1") == 7

    async def by_model(token: str, wanted: list[str], limit: int = 2) -> list[int]:
        async with store.tx() as conn:
            rows = await sr.claim(
                conn,
                batch_id="batch_1",
                limit=limit,
                worker="w",
                token=token,
                now_ms=1000,
                ttl_ms=500,
                skip_locked=store.skip_locked,
                models=wanted,
            )
        return [r.line for r in rows]

    assert await by_model("t1", ["live"]) == [3, 5]  # lowest lines of that model first, lines 1-2 left alone
    assert await by_model("t2", ["live", "other"]) == [6, 7]
    assert await by_model("t3", ["live"]) == []  # claimed already
    assert await by_model("t4", ["nobody"]) == []
    assert await claim(store, "t5", limit=10) == [1, 2, 4]  # unfiltered: what is left, of any model
    assert await record(store, 3, "t1")
    async with store.tx() as conn:
        assert await sr.count_pending(conn, "batch_1", models=["live"]) == 2


async def test_concurrent_claims_by_model_never_overlap(store: Store) -> None:
    await make_batch(store, 40, models=[f"m{i % 2}" for i in range(40)])

    async def by_model(token: str, model: str) -> list[int]:
        async with store.tx() as conn:
            rows = await sr.claim(
                conn,
                batch_id="batch_1",
                limit=3,
                worker="w",
                token=token,
                now_ms=1000,
                ttl_ms=500,
                skip_locked=store.skip_locked,
                models=[model],
            )
        assert all(r.line % 2 == (1 if model == "m0" else 0) for r in rows)
        return [r.line for r in rows]

    results = await asyncio.gather(*(by_model(f"t{i}", f"m{i % 2}") for i in range(16)))
    lines = [line for r in results for line in r]
    assert sorted(lines) == list(range(1, 41))


async def test_terminal_status_is_never_overwritten(store: Store) -> None:
    await make_batch(store, 1)
    [line] = await claim(store, "t1")
    async with store.tx() as conn:
        with pytest.raises(StaleStatus):  # a row is still pending: the batch cannot finish
            await sb.transition(conn, "batch_1", ("in_progress",), "finalizing", 3)
    async with store.tx() as conn:
        recorded = await sr.record_many(
            conn, batch_id="batch_1", token="t1", results=[sr.RowResult(line, True, "{}", 1, 1)]
        )
        assert recorded == sr.Recorded(frozenset({line}), "in_progress", False)
        await sb.transition(conn, "batch_1", ("in_progress",), "finalizing", 3)
        await sb.transition(conn, "batch_1", ("finalizing",), "completed", 4)
        cancellable = ("validating", "in_progress", "finalizing")
        assert not await sb.try_transition(conn, "batch_1", cancellable, "cancelling", 5)
        with pytest.raises(StaleStatus):
            await sb.transition(conn, "batch_1", cancellable, "cancelling", 5)
        b = await sb.get_batch(conn, "batch_1")
    assert b is not None and b.status == "completed" and b.cancelling_at is None and b.completed_at == 4


async def test_schema_refuses_duplicate_valid_custom_ids(store: Store) -> None:
    await make_batch(store, 1)
    with pytest.raises(IntegrityError):
        async with store.tx() as conn:
            await sr.insert_rows(conn, "batch_1", [{"line": 9, "custom_id": "r0", "valid": True, "body": "{}"}])
    # an invalid duplicate is allowed: it is recorded as an error row
    async with store.tx() as conn:
        await sr.insert_rows(conn, "batch_1", [{"line": 9, "custom_id": "r0", "valid": False, "result": "{}"}])


async def test_schema_refuses_counts_beyond_total(store: Store) -> None:
    await make_batch(store, 1)
    with pytest.raises(IntegrityError):
        async with store.tx() as conn:
            await sb.set_fields(conn, "batch_1", ("in_progress",), completed=2)


async def test_file_bytes_round_trip_in_chunks(store: Store) -> None:
    payload = bytes(range(256)) * 9000  # 2.3 MB: three chunks
    async with store.tx() as conn:
        rec = await sf.insert_file(
            conn,
            file_id="file-big",
            purpose="batch",
            filename="big.jsonl",
            created_at=1,
            expires_at=None,
            chunks=[payload[i : i + 70_000] for i in range(0, len(payload), 70_000)],
            owner_key_id=None,
        )
    assert rec.bytes == len(payload)
    got = b"".join([c async for c in store.file_content("file-big")])
    assert got == payload


async def test_a_download_cut_in_the_middle_of_a_read_leaves_the_connection_good(store: Store) -> None:
    """A reader cancelled while a piece is being read (a client that disconnects from a download: Starlette cancels
    the response's task) lets the read finish; the connection goes back to the pool instead of being invalidated
    (SQLAlchemy invalidates a connection whose statement a cancellation cut, and aiosqlite leaves a closing task that
    asyncio reports as destroyed)."""
    pieces = [bytes([i]) * 1000 for i in range(3)]
    async with store.tx() as conn:
        await sf.insert_file(
            conn,
            file_id="file-cut",
            purpose="batch",
            filename="cut.jsonl",
            created_at=1,
            expires_at=None,
            chunks=pieces,
            owner_key_id=None,
        )
    invalidated: list[object] = []
    reads = 0
    reader: asyncio.Task[list[bytes]] | None = None

    def on_invalidate(_dbapi_conn: object, _record: object, exc: object) -> None:
        invalidated.append(exc)

    def on_execute(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        nonlocal reads
        if "file_chunks" in statement:
            reads += 1
            if reads == 2 and reader is not None:
                reader.cancel()  # delivered while the second piece's read is in flight

    event.listen(store.engine.sync_engine, "invalidate", on_invalidate)
    event.listen(store.engine.sync_engine, "before_cursor_execute", on_execute)
    try:

        async def read_all() -> list[bytes]:
            return [piece async for piece in store.file_content("file-cut")]

        reader = asyncio.create_task(read_all())
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert b"".join([c async for c in store.file_content("file-cut")]) == b"".join(pieces)
    finally:
        event.remove(store.engine.sync_engine, "invalidate", on_invalidate)
        event.remove(store.engine.sync_engine, "before_cursor_execute", on_execute)
    assert reads >= 2
    assert invalidated == []


async def test_list_files_pages_without_gaps(store: Store) -> None:
    async with store.tx() as conn:
        for i in range(7):
            await sf.insert_file(
                conn,
                file_id=f"file-{i:02d}",
                purpose="batch",
                filename="f",
                created_at=i,
                expires_at=None,
                chunks=[],
                owner_key_id=None,
            )
    seen: list[str] = []
    after = None
    while True:
        async with store.tx() as conn:
            page, more = await sf.list_files(conn, purpose=None, limit=3, order="desc", after=after)
        seen += [f.id for f in page]
        if not more:
            break
        after = page[-1].id
    assert seen == [f"file-{i:02d}" for i in reversed(range(7))]


async def test_a_sqlite_connection_given_back_inside_a_transaction_is_rolled_back(tmp_path: Path) -> None:
    """The SQLite pool rolls back only a connection still in a transaction (it skips the rollback after a commit):
    a write SQLAlchemy did not see must not stay open in the pool, holding the write lock and an old snapshot."""
    store = await Store.open(f"sqlite:///{tmp_path / 'reset.db'}")
    try:
        await make_batch(store, 1)
        async with store.engine.connect() as conn:

            def write_unseen(sync_conn: object) -> None:
                cursor = sync_conn.connection.dbapi_connection.cursor()  # type: ignore[attr-defined]
                cursor.execute("UPDATE batches SET total = 7 WHERE id = 'batch_1'")  # begins a transaction

            await conn.run_sync(write_unseen)
        async with store.tx() as conn:  # the write lock is free again (busy for 30 s otherwise)
            await sb.set_fields(conn, "batch_1", ("in_progress",), waiting_reason="queued")
        async with store.read() as conn:
            b = await sb.get_batch(conn, "batch_1")
        assert b is not None and (b.total, b.waiting_reason) == (1, "queued")
    finally:
        await store.close()
