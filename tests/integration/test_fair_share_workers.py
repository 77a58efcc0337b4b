"""Fair share across workers, on SQLite and PostgreSQL: two runners on one database (each with its own fake engine,
as two ``miserver worker`` processes) share the engines' rows between two tenants as one runner would, because the
counts are the database's (``store.fair_share``), not a process's. Also the store's statements of that count: the
first admission wins, a charge that finds no entry is loud, a give-back of a departed batch changes nothing, and an
owner with no ``in_progress`` batch is forgotten."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from miserver.batches.runner import BatchRunner
from miserver.clock import now
from miserver.engines.base import PoolRequest, Vector
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference.context import ServiceContext
from miserver.settings import Settings
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import fair_share as sfair
from miserver.store import keys as sk
from miserver.store.batches import BatchRecord
from miserver.store.schema import fair_share
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.stored import stored_batch

ENDPOINT = "/v1/embeddings"
#: The two tenants (API keys) and the first word of their rows' inputs: the fake engine's token ids are word lengths,
#: so the first token of an executed row names its tenant.
LARGE, SMALL = "key_large", "key_small"
FIRST_TOKEN = {LARGE: 1, SMALL: 2}
WORD = {LARGE: "L", SMALL: "SS"}
#: Seconds of engine work per row.
ROW_SECONDS = 0.005


def runner_for(store: Store, worker: str, engine: FakeEngine, **overrides: Any) -> BatchRunner:
    values: dict[str, Any] = {"batch_chunk_rows": 8, "batch_chunk_seconds": 3600.0, "batch_poll_seconds": 0.05}
    values.update(overrides)
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)
    return BatchRunner(store, ctx, Settings(**values), worker_id=worker)


def two_workers(store: Store, **overrides: Any) -> tuple[list[BatchRunner], list[tuple[int, ...]]]:
    """Two runners on ``store`` with engines of their own that log every row they run into one list (in the order
    the rows ran, across both)."""
    engines = [FakeEngine(), FakeEngine()]
    engines[1].executed = engines[0].executed
    return [runner_for(store, f"w{i}", e, **overrides) for i, e in enumerate(engines)], engines[0].executed


async def add_keys(store: Store) -> None:
    async with store.tx() as conn:
        for key in (LARGE, SMALL):
            await sk.insert_key(
                conn,
                key_id=key,
                name=key,
                digest=key.ljust(64, "0"),
                prefix=key[:8],
                admin=False,
                balance=None,
                max_pending_batches=None,
                max_enqueued_tokens=None,
                created_at=now(),
            )


async def create_batch(store: Store, owner: str, rows: int, tag: str) -> BatchRecord:
    """A ``validating`` batch of ``owner``'s with ``rows`` embedding lines (inputs ``<tenant word> <tag> w...``)."""
    lines = []
    for i in range(rows):
        body = {"model": MODEL, "input": f"{WORD[owner]} {tag} " + "w" * (i % 40 + 1)}
        lines.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": ENDPOINT, "body": body}))
    content = ("\n".join(lines) + "\n").encode()
    return await stored_batch(store, content, endpoint=ENDPOINT, owner=owner)


async def terminal(store: Store, batch_ids: Sequence[str]) -> bool:
    async with store.tx() as conn:
        return all([(b := await sb.get_batch(conn, i)) is not None and b.terminal for i in batch_ids])


class Working(FakeEngine):
    """The fake engine with a cost per row (:data:`ROW_SECONDS`, standing for the model's work), so that two workers'
    chunks run side by side as two processes' do."""

    async def embed(self, request: PoolRequest) -> Vector:
        await asyncio.sleep(ROW_SECONDS)
        return await super().embed(request)


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` every 10 ms (bounded: 60 s) while the runners work; the caller asserts what it waited for."""
    for _ in range(6000):
        if await check():
            return
        await asyncio.sleep(0.01)


async def recorded(store: Store, batch_id: str) -> int:
    async with store.tx() as conn:
        batch = await sb.get_batch(conn, batch_id)
    return 0 if batch is None else batch.completed + batch.failed


async def small_tenant_work(store: Store, *, with_large: bool) -> int:
    """The measure on two workers running side by side, in engine work: the small tenant's 100 rows (ten batches of
    10, created one after another) plus the rows the engines ran for the large tenant from the last small batch's
    creation to the last one's end, with or without the large tenant's 300-row batch running beside them (it has
    recorded two chunks when the small tenant comes). The large rows run while the small batches are being created
    are left out: they measure how fast this test inserts batches on a loaded machine, not the share."""
    engines = [Working(), Working()]
    engines[1].executed = engines[0].executed  # one log, in the order the rows ran on either engine
    runners = [runner_for(store, f"w{i}", e) for i, e in enumerate(engines)]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    try:
        # each runner releases stale claims as it starts (on SQLite, every claim): both have, before any claim
        await until(_both_started)
        if with_large:
            large = await create_batch(store, LARGE, 300, "big")
            await until(lambda: _at_least(store, large.id, 16))
        before = len(engines[0].executed)
        small = [(await create_batch(store, SMALL, 10, f"s{j}")).id for j in range(10)]
        created = len(engines[0].executed)  # the large tenant's rows before it are the test's serial creation's
        for r in runners:
            r.wake()
        await until(lambda: terminal(store, small))
        finished = len(engines[0].executed)
        assert await terminal(store, small)
        if with_large:
            assert not await terminal(store, [large.id]), "the large batch ran beside the small ones to their end"
    finally:
        for r in runners:
            r.stop()
        await asyncio.gather(*tasks)
    ran_small = [row[0] == FIRST_TOKEN[SMALL] for row in engines[0].executed[before:finished]]
    assert ran_small.count(True) == 100, f"every small row ran once: {ran_small.count(True)}"
    ran_large = [row[0] == FIRST_TOKEN[LARGE] for row in engines[0].executed[created:finished]]
    return 100 + ran_large.count(True)


async def _both_started() -> bool:
    """Both runners are past their start (their quick-pass task, created after the start's release of claims, runs)."""
    return sum(t.get_name() == "miserver-batch-quick-pass" for t in asyncio.all_tasks()) == 2


async def _at_least(store: Store, batch_id: str, rows: int) -> bool:
    return await recorded(store, batch_id) >= rows


async def test_two_workers_keep_the_small_tenant_within_twice_its_time_alone(store: Store) -> None:
    """Two tenants, one with a 300-row batch, one with ten 10-row batches, two workers: the small tenant's batches
    finish within 2x of their work alone (its own 100 rows), plus the chunk each worker was running when they came
    (8 rows each), counted in rows the engines ran meanwhile. With a count per process (each worker ranking by its
    own chunks only) the engines ran 242-280 rows by then."""
    await add_keys(store)
    alone = await small_tenant_work(store, with_large=False)
    beside = await small_tenant_work(store, with_large=True)  # the first measure's batches have all ended
    assert alone == 100
    in_flight = 2 * 8
    assert beside <= 2 * alone + in_flight, f"small tenant: {beside} engine rows beside the large one, {alone} alone"


async def test_a_chunk_one_worker_runs_counts_in_the_other_workers_next_plan(store: Store) -> None:
    """While worker 1 runs a chunk of the large tenant's batch (its engine held inside a row), worker 2's plan sees
    that chunk's rows counted: it runs the small tenant's batch, not the large one's next chunk."""
    await add_keys(store)
    runners, _ = two_workers(store, batch_chunk_rows=2)
    large = await create_batch(store, LARGE, 8, "big")  # created first: it wins a tie
    small = await create_batch(store, SMALL, 8, "s")
    for batch in (large, small):
        assert await runners[0].validator.run(batch)
    held, other = runners[0].ctx.engine, runners[1].ctx.engine
    assert isinstance(held, FakeEngine) and isinstance(other, FakeEngine)
    other.executed = []
    held.hold.clear()
    chunk = asyncio.create_task(runners[0].step())
    await held.entered.wait()
    await runners[1].step()
    held.hold.set()
    await chunk
    assert held.executed and all(row[0] == FIRST_TOKEN[LARGE] for row in held.executed)
    assert [row[0] for row in other.executed] == [FIRST_TOKEN[SMALL]] * 2, "worker 2 ran the small tenant's chunk"
    async with store.tx() as conn:
        shares = await sfair.read(conn)
    assert shares.owners == {LARGE: 2, SMALL: 2} and shares.batches == {large.id: 2, small.id: 2}


async def test_a_chunk_cut_short_counts_only_the_rows_it_recorded(store: Store) -> None:
    """A chunk claims 5 rows, its time bound ends it after one: the 4 it gives back unrun leave the count."""
    runner = runner_for(store, "w1", FakeEngine(), batch_chunk_rows=5, batch_chunk_seconds=1e-9)
    await add_keys(store)
    batch = await create_batch(store, SMALL, 6, "t")
    assert await runner.validator.run(batch)
    await runner.advance(batch.id)
    assert len(runner.ctx.engine.executed) == 1  # type: ignore[union-attr]
    async with store.tx() as conn:
        shares = await sfair.read(conn)
    assert shares.owners == {SMALL: 1} and shares.batches == {batch.id: 1}


async def test_the_statements_of_the_count(store: Store) -> None:
    """Admission: the first start stands. A charge with no entry raises (a stale status: the runner reads the batch
    again); a give-back never takes a count below zero nor revives a departed entry. Only owners and batches with an
    ``in_progress`` batch keep their entries."""
    batch = await create_batch(store, SMALL, 2, "x")
    async with store.tx() as conn:
        assert await sfair.admit(conn, owners={SMALL: 5}, batches={batch.id: 3}) == 2
        assert await sfair.admit(conn, owners={SMALL: 0, "key_new": 7}, batches={batch.id: 0}) == 1
        assert await sfair.read(conn) == sfair.Shares({SMALL: 5, "key_new": 7}, {batch.id: 3})
        await sfair.charge(conn, owner=SMALL, batch_id=batch.id, rows=4)
        assert await sfair.give_back(conn, owner=SMALL, batch_id=batch.id, rows=8) == 2
        assert await sfair.read(conn) == sfair.Shares({SMALL: 1, "key_new": 7}, {batch.id: 0}), "never below 0"
        with pytest.raises(sb.StaleStatus):
            await sfair.charge(conn, owner="key_new", batch_id="batch_unknown", rows=1)
    async with store.tx() as conn:
        assert await sfair.forget_departed(conn) == 3, "a validating batch keeps no entry, nor its owner"
        await sfair.admit(conn, owners={SMALL: 1}, batches={batch.id: 1})
        await sb.transition(conn, batch.id, ("validating",), "in_progress", now())
        assert await sfair.forget_departed(conn) == 0
        assert await sfair.give_back(conn, owner=SMALL, batch_id="batch_gone", rows=1) == 1, "only the owner's"
        assert await sfair.read(conn) == sfair.Shares({SMALL: 0}, {batch.id: 1})
        with pytest.raises(IntegrityError):  # the schema's CHECK: a count is never below zero
            await conn.execute(update(fair_share).values(served=-1))
