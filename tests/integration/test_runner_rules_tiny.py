"""The batch runner's exactly-once, cancel and claim rules on the tiny real model (the resident engine and its step
scheduler, in-process), on SQLite and PostgreSQL: the same rules ``test_runner_rules`` proves on the fake engine.

A row is "inside the engine" once the step scheduler admitted it (``LocalEngine.on_execute``); a test that must act
while a row cannot finish holds the engine's one thread from inside (``LocalEngine.call``), so every later step of
that row waits behind it, with no sleeps.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from typing import Any

from miserver.batches.runner import BatchRunner
from miserver.clock import now, now_ms
from miserver.engines.base import GenerationRequest, PoolRequest
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.loader import LoadedModel
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference.context import ServiceContext
from miserver.settings import Settings
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import rows as sr
from miserver.store.batches import BatchRecord
from tests.integration.test_runner_rules import get, output_lines, rows_of, settle
from tests.support.stored import stored_batch
from tests.support.waiting import until

ENDPOINT = "/v1/chat/completions"
TOPICS = ["the sea", "a cat", "the moon", "bread", "rain"]


def runner_for(store: Store, engine: LocalEngine, gate: int = 1, **overrides: Any) -> BatchRunner:
    """A runner on ``engine`` behind an admission gate of ``gate`` slots (the server's is ``MAX_SEQUENCES + 1``)."""
    values: dict[str, Any] = {"batch_chunk_rows": 2, "batch_chunk_seconds": 3600.0, "batch_poll_seconds": 0.05}
    values.update(overrides)
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(gate), rng=random.Random(0), store=store)
    return BatchRunner(store, ctx, Settings(**values), worker_id="w1")


def chat_lines(tokens: list[int]) -> bytes:
    """One chat line per entry of ``tokens`` (its ``max_tokens``), each with a prompt of its own."""
    lines = []
    for i, n in enumerate(tokens):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]}
        body.update(max_tokens=n, temperature=0)
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def create_batch(store: Store, content: bytes, *, pack: bool = False) -> BatchRecord:
    return await stored_batch(store, content, endpoint=ENDPOINT, pack=pack)


class Executions:
    """Counts the prompts the engine admits (``on_execute``) and, from the ``hold_at``-th admission on (1 first),
    holds the engine thread once: :attr:`holding` is set when the thread is held, :meth:`release` lets it go."""

    def __init__(self, engine: LocalEngine, hold_at: int | None = None) -> None:
        self.engine = engine
        self.prompts: list[tuple[int, ...]] = []
        self.hold_at = hold_at
        self.holding = asyncio.Event()
        self._go = threading.Event()
        self._held: asyncio.Future[None] | None = None

    def __enter__(self) -> Executions:
        self.engine.on_execute = self._seen
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.on_execute = None
        self._go.set()

    def _seen(self, request: GenerationRequest | PoolRequest) -> None:
        self.prompts.append(tuple(request.prompt_ids))
        if len(self.prompts) == self.hold_at:
            loop = asyncio.get_running_loop()

            def block(_loaded: LoadedModel) -> None:  # on the engine thread, between two steps
                loop.call_soon_threadsafe(self.holding.set)
                self._go.wait(60)

            self._held = asyncio.ensure_future(self.engine.call(block))

    async def held(self) -> None:
        """Wait until the engine thread is held (raises ``TimeoutError`` after 30 s)."""
        await asyncio.wait_for(self.holding.wait(), 30)

    async def release(self) -> None:
        self._go.set()
        if self._held is not None:
            await self._held


async def cancel(store: Store, batch_id: str) -> None:
    async with store.tx() as conn:
        assert await sb.try_transition(conn, batch_id, ("in_progress",), "cancelling", now()), "it was running"


async def test_each_row_runs_once_and_is_recorded_once(engine: LocalEngine, store: Store) -> None:
    """Validation, one chunk, a re-validation from the stale snapshot (it claims and deletes nothing), then the rest:
    every prompt reached the model exactly once, every row has exactly one output line."""
    runner = runner_for(store, engine)
    snapshot = await create_batch(store, chat_lines([3, 3, 3, 3, 3]))
    with Executions(engine) as ran:
        assert await runner.validator.run(snapshot)
        await runner.advance(snapshot.id)  # one chunk: two rows
        assert [r.state for r in await rows_of(store, snapshot.id)] == ["done"] * 2 + ["pending"] * 3
        assert not await runner.validator.run(snapshot), "a stale snapshot claims nothing"
        runner._start_validation(snapshot)
        await asyncio.gather(*runner._validations.values())
        assert [r.state for r in await rows_of(store, snapshot.id)] == ["done"] * 2 + ["pending"] * 3
        await settle(runner, batch_ids=[snapshot.id])
        await runner.advance(snapshot.id)  # a finished batch runs nothing more
    done = await get(store, snapshot.id)
    assert (done.status, done.total, done.completed, done.failed) == ("completed", 5, 5, 0)
    assert len(ran.prompts) == 5 and set(Counter(ran.prompts).values()) == {1}, "each row's prompt ran exactly once"
    lines = await output_lines(store, done)
    assert sorted(x["custom_id"] for x in lines) == [f"r{i}" for i in range(5)]
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in lines)


async def test_a_cancel_ends_the_chunk_at_the_next_row_boundary(engine: LocalEngine, store: Store) -> None:
    """A cancel that lands while row 1 is inside the engine (its later steps held): row 1 finishes and is recorded,
    no other row of the chunk reaches the model, and the batch ends cancelled with the four others failed."""
    runner = runner_for(store, engine, batch_chunk_rows=5)
    batch = await create_batch(store, chat_lines([16, 3, 3, 3, 3]))
    assert await runner.validator.run(batch)
    with Executions(engine, hold_at=1) as ran:
        chunk = asyncio.create_task(runner.advance(batch.id))
        await ran.held()  # row 1 was admitted and prefilled; its further steps wait behind the held thread
        await cancel(store, batch.id)
        await ran.release()
        await chunk
        assert len(ran.prompts) == 1, "the running row finished; the rest of the chunk never ran"
        await runner.advance(batch.id)
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed) == ("cancelled", 1, 4)
    codes = sorted(x["error"]["code"] for x in await output_lines(store, done) if x["error"])
    assert codes == ["batch_cancelled"] * 4


async def test_a_cancel_drops_the_packed_rows_in_flight(engine: LocalEngine, store: Store) -> None:
    """Batched generation (``pack: true``, three slots): a cancel that lands while the rows are in flight is seen
    when the short row is recorded; the long rows in flight (the fourth takes the short row's slot as it ends, before
    that record) leave the step loop unrecorded, long before their 200 tokens."""
    runner = runner_for(store, engine, batch_chunk_rows=4, batch_generate_slots=3)
    batch = await create_batch(store, chat_lines([4, 200, 200, 200]), pack=True)
    assert await runner.validator.run(batch)
    first = engine.scheduler.steps
    with Executions(engine, hold_at=1) as ran:
        chunk = asyncio.create_task(runner.advance(batch.id))
        await ran.held()  # rows 1-3 admitted in one step, which ran; the next steps wait
        assert len(ran.prompts) == 3
        await cancel(store, batch.id)
        await ran.release()
        await chunk
        await engine.scheduler.idle()
        steps = engine.scheduler.steps - first
        assert steps < 150, f"the long rows left before their end ({steps} steps ran)"
        assert engine.scheduler.in_flight == 0
        assert [r.state for r in await rows_of(store, batch.id)] == ["done", "pending", "pending", "pending"]
        await runner.advance(batch.id)
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed) == ("cancelled", 1, 3)


async def test_a_taken_over_claim_cannot_record(engine: LocalEngine, store: Store) -> None:
    """Another worker takes over the chunk's claim while row 1 is inside the engine: row 1's result is dropped (its
    record is refused), the chunk ends, and the row is recorded once, by the run that holds the claim."""
    runner = runner_for(store, engine, batch_chunk_rows=5)
    batch = await create_batch(store, chat_lines([16, 3, 3]))
    assert await runner.validator.run(batch)
    with Executions(engine, hold_at=1) as ran:
        chunk = asyncio.create_task(runner.advance(batch.id))
        await ran.held()
        async with store.tx() as conn:  # the claim looks expired to a worker whose clock is far ahead
            later = now_ms() + 10**9
            taken = await sr.claim(
                conn,
                batch_id=batch.id,
                limit=10,
                worker="w2",
                token="thief",
                now_ms=later,
                ttl_ms=10**9,
                skip_locked=store.skip_locked,
            )
        assert [r.line for r in taken] == [1, 2, 3]
        await ran.release()
        await chunk
        assert len(ran.prompts) == 1, "the refused record ended the chunk"
        assert [r.state for r in await rows_of(store, batch.id)] == ["pending"] * 3
        assert (await get(store, batch.id)).completed == 0
        async with store.tx() as conn:
            await sr.release_claim(conn, batch_id=batch.id, token="thief")
        await settle(runner, batch_ids=[batch.id])
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed) == ("completed", 3, 0)
    assert Counter(ran.prompts)[ran.prompts[0]] == 2 and len(ran.prompts) == 4, "row 1 ran again, under the claim"
    lines = await output_lines(store, done)
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"], "one line per row"


async def test_the_next_window_starts_beside_the_rows_in_flight_past_the_time_bound(
    engine: LocalEngine, store: Store
) -> None:
    """A packed batch in windows of two rows whose time bound is spent as soon as their rows start: the runner's
    step returns once the first window takes no further row, and the second window's rows are admitted while the
    first window's long row still decodes (the engine's batch slots stay full across the boundary). Every row runs
    and is recorded once."""
    settings = {"batch_pack_window_rows": 2, "batch_chunk_seconds": 1e-9, "batch_generate_slots": 4}
    runner = runner_for(store, engine, gate=Settings().max_sequences + 1, **settings)
    batch = await create_batch(store, chat_lines([200, 2, 3, 3]), pack=True)
    assert await runner.validator.run(batch)
    with Executions(engine, hold_at=1) as ran:
        record = engine.on_execute
        assert record is not None
        in_flight: list[int] = []  # sequences in flight as each row is admitted (itself included)

        def admitted(request: GenerationRequest | PoolRequest) -> None:
            in_flight.append(engine.scheduler.in_flight)
            record(request)

        engine.on_execute = admitted
        await asyncio.wait_for(runner.step(), 30)  # returns at window 1's time bound
        await ran.held()  # window 1's rows 0 and 1 were admitted in one step; the engine thread is then held
        assert runner.resident.running(batch.id), "window 1 finishes in the background"
        next_window = asyncio.create_task(runner.step())
        await until(lambda: engine.scheduler.waiting(Priority.BATCH), lambda n: n == 2, what="window 2's rows queued")
        assert len(ran.prompts) == 2
        await ran.release()
        await asyncio.wait_for(next_window, 60)
        assert len(in_flight) == 4 and in_flight[2] >= 2, f"row 2 started beside row 0 ({in_flight})"
        await settle(runner, batch_ids=[batch.id])
    done = await get(store, batch.id)
    assert (done.status, done.completed, done.failed) == ("completed", 4, 0)
    assert len(ran.prompts) == 4 and set(Counter(ran.prompts).values()) == {1}, "each row's prompt ran exactly once"
