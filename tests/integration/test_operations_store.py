"""Operations (issue 14) in-process on SQLite and PostgreSQL: off-peak hours on an injected clock (the batch waits,
then starts; a near deadline starts it early), the create-time refusal of a batch that cannot finish in its window,
measured rates, and webhook events written in the transaction of the status change."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from miserver.clock import now
from miserver.errors import InvalidRequestError
from miserver.ids import ordered_id
from miserver.services.batch_api import batches as batches_service
from miserver.services.batch_api import operations
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf
from miserver.store import operations as so
from miserver.store import outbox as sob
from tests.integration.test_runner_rules import ENDPOINT, create_batch, get, input_lines, runner_for
from tests.support.fake_engine import MODEL
from tests.support.inprocess import installed_clock


def _at(hour: int, minute: int = 0) -> float:
    """The next UTC time of day ``hour:minute`` after the present."""
    today = datetime.now(UTC).replace(hour=hour, minute=minute, second=0, microsecond=0)
    return (today + timedelta(days=1)).timestamp()


async def _steps(runner: object, passes: int = 6) -> None:
    for _ in range(passes):
        await runner.step()  # type: ignore[attr-defined]
        await asyncio.gather(*runner._validations.values())  # type: ignore[attr-defined]


async def test_off_peak_waits_then_starts_and_a_near_deadline_starts_early(store: Store) -> None:
    with installed_clock() as clock:
        clock.offset = _at(12) - clock()  # noon UTC, outside the batch hours
        runner = runner_for(store, batch_hours="22:00-07:00")
        relaxed = await create_batch(store, input_lines("r", 3))
        await _steps(runner)
        waiting = await get(store, relaxed.id)
        assert (waiting.status, waiting.waiting_reason, waiting.completed) == ("in_progress", "off_peak", 0)

        # a measured rate of 1 row/s: a 3-row batch with 60 s left must start now (3 s x 1.25 + 60 s margin)
        async with store.tx() as conn:
            await so.record_rate(conn, model=MODEL, endpoint=ENDPOINT, rows=1, tokens=4, seconds=1.0, at=now())
        urgent = await create_batch(store, input_lines("u", 3), window=60)
        await _steps(runner, passes=10)
        done = await get(store, urgent.id)
        assert (done.status, done.completed) == ("completed", 3), "a near deadline starts a batch off-peak"
        still = await get(store, relaxed.id)
        assert (still.status, still.waiting_reason, still.completed) == ("in_progress", "off_peak", 0)
        assert still.estimated_completion_at is not None and still.estimated_completion_at >= _at(22) - 86400

        clock.offset += 10.5 * 3600  # 22:30: the window is open
        await _steps(runner, passes=10)
        finished = await get(store, relaxed.id)
        assert (finished.status, finished.completed) == ("completed", 3)


async def test_a_paused_batch_runs_nothing_until_resumed(store: Store) -> None:
    runner = runner_for(store)
    batch = await create_batch(store, input_lines("p", 4))
    await _steps(runner, passes=1)
    async with store.tx() as conn:
        await sb.set_fields(conn, batch.id, ("in_progress",), paused_at=now())
    await _steps(runner)
    paused = await get(store, batch.id)
    assert (paused.status, paused.waiting_reason, paused.completed) == ("in_progress", "paused", 0)
    async with store.tx() as conn:
        await sb.set_fields(conn, batch.id, ("in_progress",), paused_at=None)
    await _steps(runner, passes=10)
    assert (await get(store, batch.id)).status == "completed"


async def test_a_batch_that_ended_while_paused_does_not_report_paused(store: Store) -> None:
    """``millm.paused`` says that a batch will not run until resumed: a paused batch that was cancelled, expired or
    failed has ended, and says ``paused: false`` (the one still paused says true)."""
    with installed_clock() as clock:
        runner = runner_for(store)
        cancelled = await create_batch(store, input_lines("c", 3))
        expired = await create_batch(store, input_lines("e", 3), window=60)
        failed = await create_batch(store, b'{"custom_id": "x", "method": "POST"}\n')  # no valid line
        still = await create_batch(store, input_lines("s", 3))
        for batch in (cancelled, expired, failed, still):
            assert (await operations.pause(store, batch.id))["millm"]["paused"] is True
        await _steps(runner)
        await batches_service.cancel_batch(store, cancelled.id)
        clock.offset += 120  # past the 60 s window
        await _steps(runner)
        ended = {b.id: await batches_service.retrieve_batch(store, b.id) for b in (cancelled, expired, failed)}
        assert [b["status"] for b in ended.values()] == ["cancelled", "expired", "failed"]
        assert [b["millm"]["paused"] for b in ended.values()] == [False, False, False]
        live = await batches_service.retrieve_batch(store, still.id)
        assert (live["status"], live["millm"]["paused"], live["millm"]["waiting_reason"]) == (
            "in_progress",
            True,
            "paused",
        )


async def _input_file(store: Store, rows: int) -> str:
    lines = [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT, "body": {"model": MODEL, "input": "x"}})
        for i in range(rows)
    ]
    file_id = ordered_id("file-")
    async with store.tx() as conn:
        await sf.insert_file(
            conn,
            file_id=file_id,
            purpose="batch",
            filename="in.jsonl",
            created_at=now(),
            expires_at=None,
            chunks=[("\n".join(lines) + "\n").encode()],
            owner_key_id=None,
        )
    return file_id


async def test_a_batch_that_cannot_finish_in_its_window_is_refused_unless_late_is_allowed(store: Store) -> None:
    file_id = await _input_file(store, 100)
    body = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "1h"}

    async def create(**extra: object) -> dict[str, object]:
        form = batches_service.BatchCreate(raw=json.dumps({**body, **extra}).encode())
        return await batches_service.create_batch(store, form, max_window_hours=168, pack_default=False)

    first = await create()  # no rate measured yet: nothing to refuse on
    assert first["millm"]["estimated_completion_at"] is None  # type: ignore[index]
    async with store.tx() as conn:  # 0.01 rows/s: 100 rows take 10,000 s, over the 1 h window
        await so.record_rate(conn, model=MODEL, endpoint=ENDPOINT, rows=1, tokens=1, seconds=100.0, at=now())
    with pytest.raises(InvalidRequestError) as refused:
        await create()
    assert refused.value.param == "completion_window" and refused.value.code == "completion_window_too_short"
    assert "2h46m40s" in refused.value.message and "1h00m00s" in refused.value.message
    assert "100 rows" in refused.value.message and "millm_allow_late" in refused.value.message
    late = await create(millm_allow_late=True, priority=3)
    async with store.tx() as conn:
        record = await sb.get_batch(conn, str(late["id"]))
    assert record is not None and record.allow_late and record.priority == 3
    assert (await create(completion_window="4h"))["status"] == "validating"


async def test_rates_are_moving_averages(store: Store) -> None:
    async with store.tx() as conn:
        first = await so.record_rate(conn, model="m", endpoint="/e", rows=10, tokens=100, seconds=1.0, at=1)
        second = await so.record_rate(conn, model="m", endpoint="/e", rows=20, tokens=100, seconds=1.0, at=2)
        assert await so.record_rate(conn, model="m", endpoint="/e", rows=0, tokens=0, seconds=1.0, at=3) is None
        stored = (await so.rates(conn))[("m", "/e")]
    assert first is not None and first.rows_per_second == 10.0
    assert second is not None and second.rows_per_second == pytest.approx(0.3 * 20 + 0.7 * 10)
    assert stored.samples == 2 and stored.tokens_per_second == pytest.approx(100.0)


async def test_status_change_and_its_webhook_events_commit_together(store: Store) -> None:
    batch = await create_batch(store, input_lines("w", 1))
    async with store.tx() as conn:
        hook = await sob.insert_webhook(
            conn,
            url="https://example.com/h",
            events=["batch.cancelled"],
            secret="whsec_x",
            owner_key_id=None,
            created_at=0,
        )
        other = await sob.insert_webhook(
            conn,
            url="https://example.com/o",
            events=["batch.failed"],
            secret="whsec_y",
            owner_key_id=None,
            created_at=0,
        )
    with pytest.raises(RuntimeError):
        async with store.tx() as conn:
            await sb.transition(conn, batch.id, ("validating",), "cancelling", now())
            await sb.transition(conn, batch.id, ("cancelling",), "cancelled", now())
            assert (await sob.counts(conn))["pending"] == 1
            raise RuntimeError("roll back")
    async with store.tx() as conn:
        assert (await sob.counts(conn))["pending"] == 0, "rolled back with the status change"
        await sb.transition(conn, batch.id, ("validating",), "cancelling", now())
        await sb.transition(conn, batch.id, ("cancelling",), "cancelled", now())
    async with store.tx() as conn:
        at = now() * 1000 + 1  # one instant for both claims: now() has whole seconds, and a second may turn between
        due = await sob.claim_due(conn, worker="w", now_ms=at, claim_ms=1000, limit=10, skip_locked=False)
        assert [d.event_type for d in due] == ["batch.cancelled"] and due[0].url == hook.url
        assert json.loads(due[0].payload)["data"] == {"id": batch.id}
        again = await sob.claim_due(conn, worker="w", now_ms=at + 999, claim_ms=1000, limit=10, skip_locked=False)
        assert again == [], "a claimed event is not due again before its claim ends"
        assert await sob.release_claims(conn, worker="w", now_ms=0) == 1
        await sob.delivered(conn, due[0].id, at=now())
        assert await sob.counts(conn) == {"pending": 0, "delivered": 1, "failed": 0}
        assert other.events == ["batch.failed"]


async def test_progress_events_are_written_at_most_every_interval(store: Store) -> None:
    batch = await create_batch(store, input_lines("g", 1))
    async with store.tx() as conn:
        await sob.insert_webhook(
            conn,
            url="https://example.com/p",
            events=["batch.progress"],
            secret="whsec_x",
            owner_key_id=None,
            created_at=0,
        )
        await sob.insert_webhook(
            conn,
            url="https://example.com/q",
            events=["batch.progress"],
            secret="whsec_y",
            owner_key_id="key_other",
            created_at=0,
        )
        written = [
            await sob.enqueue_progress(conn, batch_id=batch.id, owner_key_id=None, at=at, min_interval=60)
            for at in (1000, 1030, 1060, 1100)
        ]
    assert written == [1, 0, 1, 0], "one endpoint (the other key's sees nothing), at most every 60 s"
