"""The batch runner's rules on a fake engine, in-process, on SQLite and PostgreSQL (no spawned server).

Covers the race of issue 9 (a stale snapshot re-validating a running batch and deleting its recorded rows), the
guards of every state change, the one row loop's early ends (cancel at a row boundary, interactive first, the time
bound, a lost claim), waiting reasons, and two runners racing the same batches on one database.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from miserver.batches.runner import BatchRunner
from miserver.clock import now
from miserver.engines.base import PoolRequest, Vector
from miserver.model_lease import LeaseManager
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference.context import ServiceContext
from miserver.settings import Settings
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import rows as sr
from miserver.store.batches import BatchRecord, StaleStatus
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.stored import stored_batch
from tests.support.waiting import eventually, until

ENDPOINT = "/v1/embeddings"


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {"batch_chunk_rows": 2, "batch_chunk_seconds": 3600.0, "batch_poll_seconds": 0.05}
    values.update(overrides)
    return Settings(**values)


def runner_for(store: Store, worker: str = "w1", engine: FakeEngine | None = None, **overrides: Any) -> BatchRunner:
    ctx = ServiceContext(engine=engine or FakeEngine(), gate=AdmissionGate(1), rng=random.Random(0), store=store)
    return BatchRunner(store, ctx, settings(**overrides), worker_id=worker)


def fake(runner: BatchRunner) -> FakeEngine:
    assert isinstance(runner.ctx.engine, FakeEngine)
    return runner.ctx.engine


def input_lines(prefix: str, count: int) -> bytes:
    """``count`` embedding lines whose inputs have ``i + 1`` words of distinct lengths (so each row is traceable)."""
    lines = []
    for i in range(count):
        body = {"model": MODEL, "input": f"{prefix} " + "w" * (i + 1)}
        lines.append(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def create_batch(store: Store, content: bytes, *, window: int = 86400, pack: bool = False) -> BatchRecord:
    return await stored_batch(store, content, endpoint=ENDPOINT, window=window, pack=pack)


async def get(store: Store, batch_id: str) -> BatchRecord:
    async with store.tx() as conn:
        batch = await sb.get_batch(conn, batch_id)
    assert batch is not None
    return batch


async def rows_of(store: Store, batch_id: str) -> list[sr.StoredRow]:
    async with store.tx() as conn:
        return [r async for r in sr.iter_rows(conn, batch_id)]


async def settle(*runners: BatchRunner, batch_ids: list[str], passes: int = 200) -> None:
    """Step the runners until every batch is terminal (validation tasks run between passes)."""
    store = runners[0].store
    for _ in range(passes):
        statuses = [(await get(store, b)).status for b in batch_ids]
        if all(s in ("completed", "failed", "expired", "cancelled") for s in statuses):
            return
        for r in runners:
            await r.step()
        for r in runners:
            if r._validations:
                await asyncio.gather(*list(r._validations.values()), return_exceptions=True)
    raise AssertionError(f"batches did not finish: {statuses}")


async def _statuses(store: Store, batch_ids: tuple[str, ...]) -> tuple[str, ...]:
    return tuple([(await get(store, b)).status for b in batch_ids])


async def _expiry(runner: BatchRunner) -> float | None:
    current = runner.ctx.leases.current()
    return None if current is None else current.expires_at


async def output_lines(store: Store, batch: BatchRecord) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            data = b"".join([c async for c in store.file_content(file_id)])
            found += [json.loads(x) for x in data.decode().splitlines()]
    return found


async def test_a_stale_snapshot_never_revalidates_a_running_batch(store: Store) -> None:
    """The issue's reproduction: validate, record line 1, then validate again from the old snapshot."""
    runner = runner_for(store, batch_chunk_rows=1)
    snapshot = await create_batch(store, input_lines("a", 3))
    assert await runner.validator.run(snapshot)
    assert (await get(store, snapshot.id)).status == "in_progress"
    await runner.advance(snapshot.id)  # one chunk: line 1
    assert [r.state for r in await rows_of(store, snapshot.id)] == ["done", "pending", "pending"]

    assert not await runner.validator.run(snapshot), "the claim names 'validating': a stale snapshot claims nothing"
    runner._start_validation(snapshot)  # the runner's own path from the stale snapshot
    await asyncio.gather(*runner._validations.values())
    assert not runner._validations, "a finished validation task removes itself"
    assert [r.state for r in await rows_of(store, snapshot.id)] == ["done", "pending", "pending"]
    assert (await get(store, snapshot.id)).completed == 1

    await settle(runner, batch_ids=[snapshot.id])
    done = await get(store, snapshot.id)
    assert (done.status, done.total, done.completed, done.failed) == ("completed", 3, 3, 0)
    assert len(fake(runner).executed) == 3, "every row ran exactly once"


async def test_a_batch_created_while_another_runs_waits_queued_then_runs(store: Store) -> None:
    """The issue's journey: B created once A recorded its first row waits ``queued``, then completes all its rows."""
    runner = runner_for(store)
    a = await create_batch(store, input_lines("a", 10))
    for _ in range(20):
        await runner.step()
        await asyncio.gather(*runner._validations.values())
        if (await get(store, a.id)).completed:
            break
    b = await create_batch(store, input_lines("b", 4))
    reasons = set()
    for _ in range(200):
        await runner.step()
        await asyncio.gather(*runner._validations.values())
        current_a, current_b = await get(store, a.id), await get(store, b.id)
        if current_b.status == "in_progress" and current_a.status == "in_progress":
            reasons.add(current_b.waiting_reason)
        if current_a.terminal and current_b.terminal:
            break
    assert "queued" in reasons
    for batch, count in ((a, 10), (b, 4)):
        done = await get(store, batch.id)
        assert (done.status, done.total, done.completed, done.failed) == ("completed", count, count, 0)
        assert all(line["error"] is None for line in await output_lines(store, done))
    assert len(fake(runner).executed) == 14


async def test_every_state_change_is_guarded(store: Store) -> None:
    runner = runner_for(store)
    batch = await create_batch(store, input_lines("g", 3))
    assert await runner.validator.run(batch)
    async with store.tx() as conn:
        with pytest.raises(StaleStatus):  # rows are pending: a stale read cannot finish the batch
            await sb.transition(conn, batch.id, ("in_progress",), "finalizing", now())
    async with store.tx() as conn:
        with pytest.raises(StaleStatus):
            await sb.transition(conn, batch.id, ("finalizing",), "completed", now())
    async with store.tx() as conn:
        assert await sr.delete_rows(conn, batch.id, worker="w1") == 0, "rows of a running batch are never deleted"
    async with store.tx() as conn:
        with pytest.raises(StaleStatus):
            await sb.set_fields(conn, batch.id, ("validating",), total=99)
    assert len(await rows_of(store, batch.id)) == 3

    # A worker still running a row when the batch is cancelled and finished cannot record it afterwards.
    async with store.tx() as conn:
        claimed = await sr.claim(
            conn,
            batch_id=batch.id,
            limit=1,
            worker="w2",
            token="late",
            now_ms=0,
            ttl_ms=10**12,
            skip_locked=store.skip_locked,
        )
        await sb.transition(conn, batch.id, ("in_progress",), "cancelling", now())
    await runner.advance(batch.id)
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed, done.total) == ("cancelled", 0, 3, 3)
    async with store.tx() as conn:
        late = await sr.record_many(
            conn, batch_id=batch.id, token="late", results=[sr.RowResult(claimed[0].line, True, "{}", 1, 0)]
        )
        assert late == sr.Recorded(frozenset(), "cancelled", False)
    async with store.tx() as conn:
        with pytest.raises(StaleStatus):  # no waiting reason on a finished batch
            await sb.set_fields(conn, batch.id, ("in_progress",), waiting_reason="queued")
    assert (await get(store, batch.id)).completed == 0


async def test_a_cancel_ends_the_chunk_at_the_next_row_boundary(store: Store) -> None:
    runner = runner_for(store, batch_chunk_rows=5)
    engine = fake(runner)
    batch = await create_batch(store, input_lines("c", 5))
    assert await runner.validator.run(batch)
    engine.hold.clear()
    chunk = asyncio.create_task(runner.advance(batch.id))
    await engine.entered.wait()  # row 1 is inside the engine
    async with store.tx() as conn:
        assert await sb.try_transition(conn, batch.id, ("in_progress",), "cancelling", now())
    engine.hold.set()
    await chunk
    assert len(engine.executed) == 1, "the running row finished; the rest of the chunk never ran"
    await runner.advance(batch.id)
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed) == ("cancelled", 1, 4)
    codes = [x["error"]["code"] for x in await output_lines(store, done) if x["error"]]
    assert codes == ["batch_cancelled"] * 4


async def test_an_interactive_request_does_not_end_the_chunk(store: Store) -> None:
    runner = runner_for(store, batch_chunk_rows=5)
    engine = fake(runner)
    batch = await create_batch(store, input_lines("i", 5))
    assert await runner.validator.run(batch)
    engine.hold.clear()
    chunk = asyncio.create_task(runner.advance(batch.id))
    await engine.entered.wait()
    interactive = asyncio.create_task(runner.ctx.gate.acquire(Priority.INTERACTIVE))
    gate = runner.ctx.gate
    await until(lambda: gate.queue_length(Priority.INTERACTIVE), lambda n: n == 1, what="the chat queued at the gate")
    engine.hold.set()
    await chunk
    runner.ctx.gate.release(await interactive)
    # the engine's step scheduler admits interactive sequences beside the batch's: no row is left for them
    assert len(engine.executed) == 5
    assert [r.state for r in await rows_of(store, batch.id)] == ["done"] * 5


async def test_the_time_bound_ends_a_chunk_after_its_first_row(store: Store) -> None:
    runner = runner_for(store, batch_chunk_rows=5, batch_chunk_seconds=1e-9)
    batch = await create_batch(store, input_lines("t", 3))
    assert await runner.validator.run(batch)
    await runner.advance(batch.id)
    assert len(fake(runner).executed) == 1, "a chunk always makes progress, then its time bound ends it"


async def test_past_its_time_bound_a_chunk_goes_on_until_another_batch_takes_the_engine(store: Store) -> None:
    """A packed window run by the runner's loop hands the engine back to the plan at its time bound and goes on in
    the background; when the plan picks another batch, it is closed first: its row in flight finishes and is recorded,
    its other rows go back to pending, and only then does the other batch run."""
    runner = runner_for(store, batch_chunk_seconds=1e-9, batch_pack_token_budget=1)  # packed: a row per pack
    engine = fake(runner)
    lines = [input_lines("aa", 5), input_lines("bbb", 5)]
    batches = [await create_batch(store, content, pack=True) for content in lines]
    for batch in batches:
        assert await runner.validator.run(batch)
    engine.hold.clear()
    await asyncio.wait_for(runner.step(), 10)  # returns at the time bound, the chunk's first row inside the engine
    await engine.entered.wait()
    first = next(b for b in batches if b.id == runner.resident.background())
    other = next(b for b in batches if b is not first)
    taking = asyncio.create_task(runner.step())  # fair share picks the other batch: the background chunk closes
    await until(runner.resident.closed, what="the background chunk closed")
    engine.hold.set()
    await taking
    await runner.resident.settle()  # the other batch's chunk, past its time bound in turn, closes after its row
    word = {batches[0].id: 2, batches[1].id: 3}  # each row's first token: its prefix's length
    assert [row[0] for row in engine.executed] == [word[first.id], word[other.id]], "one row each, in that order"
    assert [r.state for r in await rows_of(store, first.id)] == ["done"] + ["pending"] * 4
    assert runner.resident.background() is None


async def test_under_a_batch_share_no_chunk_goes_on_while_the_engine_is_left_idle(store: Store) -> None:
    """With ``MISERVER_BATCH_SHARE`` below 1 and interactive traffic just admitted, the idle time the runner leaves
    after a chunk is idle: a chunk past its time bound is closed and ends (its row in flight recorded) first."""
    runner = runner_for(store, batch_chunk_seconds=1e-9, batch_share=0.5, batch_pack_token_budget=1)
    engine = fake(runner)
    batch = await create_batch(store, input_lines("s", 5), pack=True)
    assert await runner.validator.run(batch)
    gate = runner.ctx.gate
    gate.release(await gate.acquire(Priority.INTERACTIVE))  # an interactive request was admitted just now
    engine.hold.clear()
    step = asyncio.create_task(runner.step())
    await engine.entered.wait()
    await until(runner.resident.closed, what="the chunk closed before the idle time")
    engine.hold.set()
    await asyncio.wait_for(step, 10)
    assert runner.resident.background() is None and len(engine.executed) == 1
    assert [r.state for r in await rows_of(store, batch.id)] == ["done"] + ["pending"] * 4


async def test_waiting_reasons(store: Store) -> None:
    runner = runner_for(store)
    batch = await create_batch(store, input_lines("w", 2))
    assert await runner.validator.run(batch)
    engine = runner.ctx.engine
    runner.ctx.engine = None
    assert not await runner.advance(batch.id)
    assert (await get(store, batch.id)).waiting_reason == "model_not_resident"
    runner.ctx.engine = engine
    holder = runner.ctx.leases.acquire("alice", 60)
    assert not await runner.advance(batch.id)
    assert (await get(store, batch.id)).waiting_reason == "lease_unavailable"
    runner.ctx.leases.release(holder.lease)
    await settle(runner, batch_ids=[batch.id])
    assert (await get(store, batch.id)).status == "completed"


async def test_cancel_while_validating_accounts_for_every_line(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that arrives mid-validation lets the validation read the file to its end: every line is accounted
    for (invalid, or ``batch_cancelled``) and nothing runs."""
    runner = runner_for(store)
    content = input_lines("v", 6) + b"not json\n"
    batch = await create_batch(store, content)
    reading, resume = asyncio.Event(), asyncio.Event()
    real = store.file_content

    async def paused(file_id: str) -> AsyncIterator[bytes]:
        if file_id != batch.input_file_id:
            async for chunk in real(file_id):
                yield chunk
            return
        yield content[:10]
        reading.set()
        await resume.wait()
        yield content[10:]

    monkeypatch.setattr(store, "file_content", paused)
    runner._start_validation(batch)
    validation = runner._validations[batch.id]
    await reading.wait()
    async with store.tx() as conn:
        assert await sb.try_transition(conn, batch.id, ("validating",), "cancelling", now())
    assert not await runner.advance(batch.id), "the cancel waits for the validation reading the file"
    resume.set()
    await validation
    await runner.advance(batch.id)
    done = await get(store, batch.id)
    assert (done.status, done.total, done.completed, done.failed) == ("cancelled", 7, 0, 7)
    assert not fake(runner).executed
    lines = await output_lines(store, done)
    assert sorted(x["error"]["code"] for x in lines) == ["batch_cancelled"] * 6 + ["invalid_json_line"]
    assert done.errors is not None and [(e["line"], e["code"]) for e in done.errors] == [(7, "invalid_json_line")]


class HoldsAfter(FakeEngine):
    """A fake engine that holds the rows whose first token is ``first`` once ``ran`` (a list shared by several such
    engines) holds ``count`` of them: it sets ``inside`` and waits for ``go``.

    Its first row also waits (60 s at most) until every engine in ``met`` has begun a row, so that each of the racing
    workers surely runs rows: left to chance, a loaded machine let one worker's SQLite writes starve the other's."""

    def __init__(
        self,
        first: int,
        count: int,
        ran: list[tuple[int, ...]],
        inside: asyncio.Event,
        go: asyncio.Event,
        met: list[HoldsAfter],
    ):
        super().__init__()
        self.first, self.count, self.ran, self.inside, self.go, self.met = first, count, ran, inside, go, met
        self.began = asyncio.Event()

    async def embed(self, request: PoolRequest) -> Vector:
        if not self.began.is_set():
            self.began.set()
            async with asyncio.timeout(60):
                await asyncio.gather(*(engine.began.wait() for engine in self.met))
        if request.prompt_ids[0] == self.first:
            if len(self.ran) >= self.count:
                self.inside.set()
                await self.go.wait()
            self.ran.append(request.prompt_ids)  # no await between the count and this: the count is exact
        return await super().embed(request)


async def test_two_runners_racing_the_same_batches(store: Store) -> None:
    """Two workers on one database advance the same batches concurrently (validation, chunks, finish, a cancel):
    every row runs at most once, every batch ends with its counts adding up, and the third batch, cancelled while
    one of its rows is inside an engine after two of its rows ran, ends cancelled with its unrun rows failed."""
    third_ran: list[tuple[int, ...]] = []
    inside, cancelled = asyncio.Event(), asyncio.Event()
    met: list[HoldsAfter] = []
    engines = [HoldsAfter(3, 2, third_ran, inside, cancelled, met) for _ in range(2)]  # the third batch's is qqq
    met.extend(engines)
    one, two = runner_for(store, "w1", engines[0]), runner_for(store, "w2", engines[1])
    prefixes = ["q" * (k + 1) for k in range(3)]  # distinct word lengths: every input of every batch is distinct
    batches = [await create_batch(store, input_lines(p, 7)) for p in prefixes]
    ids = [b.id for b in batches]

    async def race(runner: BatchRunner) -> None:
        for _ in range(300):
            await runner.step()  # StaleStatus (the other worker moved a batch on) is handled there
            if runner._validations:
                await asyncio.gather(*list(runner._validations.values()), return_exceptions=True)
            if all([(await get(store, b)).terminal for b in ids]):
                return

    async def cancel_third() -> None:
        async with asyncio.timeout(60):
            await inside.wait()  # two rows of the third batch ran, a third is held inside an engine
        async with store.tx() as conn:
            assert await sb.try_transition(conn, ids[2], ("in_progress",), "cancelling", now()), "it was running"
        cancelled.set()

    await asyncio.gather(race(one), race(two), cancel_third())
    ran = fake(one).executed + fake(two).executed
    assert len(ran) == len(set(ran)), "no row ran twice"
    assert fake(one).executed and fake(two).executed, "both workers ran rows: they raced"
    for batch_id in ids:
        done = await get(store, batch_id)
        assert done.terminal and done.completed + done.failed == done.total == 7
        lines = await output_lines(store, done)
        assert sorted(x["custom_id"] for x in lines) == sorted(f"{prefixes[ids.index(batch_id)]}{i}" for i in range(7))
    assert (await get(store, ids[0])).status == (await get(store, ids[1])).status == "completed"
    third = await get(store, ids[2])
    assert third.status == "cancelled" and third.completed >= 2 and third.failed >= 1, third


async def test_a_batch_with_no_valid_line_lists_one_error_per_line(store: Store) -> None:
    """OpenAI's shape: ``errors.data`` holds one entry per invalid line (its last entry is the last bad line), no
    summary entry when the line errors explain the failure; every error line carries ``error: {code, message}``."""
    runner = runner_for(store)
    bad = b'{"custom_id": "x"}\nnot json\n\n' + input_lines("m", 1).replace(MODEL.encode(), b"nope")
    batch = await create_batch(store, bad)
    await settle(runner, batch_ids=[batch.id])
    done = await get(store, batch.id)
    assert (done.status, done.total, done.completed, done.failed) == ("failed", 3, 0, 3)
    assert done.errors is not None
    assert [(e["line"], e["code"]) for e in done.errors] == [
        (1, "missing_required_parameter"),
        (2, "invalid_json_line"),
        (4, "model_not_found"),
    ]
    lines = await output_lines(store, done)
    assert [x["millm"]["line"] for x in lines] == [1, 2, 4]
    for x in lines:
        assert x["error"] == {
            "code": x["response"]["body"]["error"]["code"],
            "message": x["response"]["body"]["error"]["message"],
        }


async def test_a_chunk_longer_than_the_lease_keeps_the_lease(store: Store) -> None:
    """The chunk's heartbeat renews the batch's lease: a row that outlasts the lease's TTL (a loaded machine) does
    not let another batch take the model between this batch's chunks."""
    now_s = [1_000_000.0]
    runner = runner_for(store, batch_claim_ttl_seconds=0.03, batch_lease_ttl_seconds=60)
    runner.ctx.leases = LeaseManager(clock=lambda: now_s[0])
    engine = fake(runner)
    batch = await create_batch(store, input_lines("l", 2))
    assert await runner.validator.run(batch)
    engine.hold.clear()
    chunk = asyncio.create_task(runner.advance(batch.id))
    await engine.entered.wait()
    lease = runner.ctx.leases.current()
    assert lease is not None and lease.holder.endswith(batch.id)
    first_expiry = lease.expires_at
    now_s[0] += 50  # the row has run for 50 of the lease's 60 seconds
    # the next heartbeat (every 10 ms of real time) renews it from the clock's now
    await eventually(
        lambda: _expiry(runner), lambda at: at is not None and at > first_expiry, what="the lease renewed by the beat"
    )
    now_s[0] += 50  # past the first expiry
    current = runner.ctx.leases.current()
    assert current is not None and current.lease == lease.lease, "the lease outlived its first TTL"
    engine.hold.set()
    await chunk


async def test_a_create_and_a_cancel_are_seen_while_another_batch_runs_a_row(store: Store) -> None:
    """While batch A's chunk is inside a row (the engine held), a new batch B validates and a cancelled batch C
    ends: the runner's quick pass does not wait for A's chunk to end."""
    runner = runner_for(store)
    engine = fake(runner)
    a = await create_batch(store, input_lines("a", 3))
    engine.hold.clear()
    loop = asyncio.create_task(runner.run())
    await engine.entered.wait()  # A's first row is inside the engine, and stays there
    b = await create_batch(store, input_lines("b", 2))
    c = await create_batch(store, input_lines("c", 2))
    async with store.tx() as conn:
        await sb.transition(conn, c.id, ("validating",), "cancelling", now())
    runner.wake()
    wanted = ("in_progress", "cancelled")
    await eventually(lambda: _statuses(store, (b.id, c.id)), lambda got: got == wanted, what=f"B, C {wanted}")
    current_b, current_c = await get(store, b.id), await get(store, c.id)
    assert (current_b.status, current_b.total) == ("in_progress", 2)
    assert (current_c.status, current_c.total, current_c.failed) == ("cancelled", 2, 2)
    assert engine.executed == [], "A's row is still held: everything above happened beside its chunk"
    engine.hold.set()
    wanted = ("completed", "completed")
    await eventually(lambda: _statuses(store, (a.id, b.id)), lambda got: got == wanted, what=f"A, B {wanted}")
    runner.stop()
    await loop
    assert [(await get(store, x.id)).status for x in (a, b)] == ["completed", "completed"]
