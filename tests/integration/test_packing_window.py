"""The one row loop (``batches.chunks.run_chunk``) on a packed window, on SQLite and PostgreSQL, with the tiny model.

Rows are claimed as the runner claims them; the loop records every row once with the claim token, marks the rows
that ran in a pack, lets a refused row fail alone, and keeps its window open while an interactive request waits (the
step scheduler starts that request at the next decode step beside the rows in flight).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from miserver.batches import chunks, packing
from miserver.engines.local.engine import LocalEngine
from miserver.scheduling.admission import AdmissionGate, Priority, Slot
from miserver.services.inference.context import ServiceContext
from miserver.services.inference.registry import SERVICES
from miserver.settings import Settings
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf
from miserver.store import rows as sr
from tests.support.waiting import until

TEXTS = ["hi", "tell me about the sea and the ships on it", "why", "what is the capital of France?", "ok then"]
SETTINGS = Settings(batch_pack_max_padding=1.0)  # rows of any length share a pack: every scoring row packs


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1, "seed": 1, **extra}


async def claimed_batch(store: Store, bodies: list[dict[str, Any]], token: str) -> list[sr.ClaimedRow]:
    """A ``pack: true`` chat batch in progress with ``bodies`` as rows, all claimed under ``token``."""
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
            batch_id="batch_1",
            endpoint="/v1/chat/completions",
            input_file_id="file-1",
            completion_window="24h",
            created_at=1,
            expires_at=86401,
            metadata=None,
            pack=True,
            output_expires_seconds=None,
        )
        rows = [
            {"line": i + 1, "custom_id": f"r{i}", "valid": True, "body": json.dumps(b)} for i, b in enumerate(bodies)
        ]
        await sr.insert_rows(conn, "batch_1", rows)
        await sb.set_fields(conn, "batch_1", ("validating",), total=len(bodies))
        await sb.transition(conn, "batch_1", ("validating",), "in_progress", 2)
        claimed = await sr.claim(
            conn,
            batch_id="batch_1",
            limit=100,
            worker="w",
            token=token,
            now_ms=1000,
            ttl_ms=10**9,
            skip_locked=store.skip_locked,
        )
    assert len(claimed) == len(bodies)
    return claimed


async def window(
    ctx: ServiceContext, store: Store, rows: list[sr.ClaimedRow], slot: Slot | None = None, token: str = "t1"
) -> chunks.ChunkReport:
    return await chunks.run_chunk(
        ctx=ctx,
        store=store,
        service=SERVICES["/v1/chat/completions"],
        batch_id="batch_1",
        token=token,
        rows=rows,
        plan=packing.runner_plan(SETTINGS),
        slot=slot,
        lease=None,
        time_limit=3600,
        stopping=lambda: False,
        on_change=lambda _id: None,
    )


async def results(store: Store) -> dict[str, dict[str, Any]]:
    async with store.tx() as conn:
        return {r.custom_id: json.loads(r.result) async for r in sr.iter_rows(conn, "batch_1") if r.result}  # type: ignore[misc]


async def test_a_window_records_every_row_once(engine: LocalEngine, store: Store) -> None:
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)
    bodies = [body(t) for t in TEXTS] + [body("longer answer", max_tokens=3), body("x " * 600)]
    rows = await claimed_batch(store, bodies, "t1")
    before = engine.executions
    await window(ctx, store, rows)
    assert engine.executions - before == len(TEXTS) + 1  # the over-long row never reaches the engine
    done = await results(store)
    assert sorted(done) == sorted(f"r{i}" for i in range(len(bodies)))
    packed = [done[f"r{i}"]["response"]["millm"]["packed"] for i in range(len(TEXTS) + 1)]
    assert packed == [True] * len(TEXTS) + [False]
    assert done["r6"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    async with store.tx() as conn:
        batch = await sb.get_batch(conn, "batch_1")
        assert batch is not None and (batch.completed, batch.failed) == (len(TEXTS) + 1, 1)
    # The same claim again: the first outcome (the refused row, answered before any pack) cannot be recorded, so the
    # window stops before running anything.
    await window(ctx, store, rows)
    assert engine.executions - before == len(TEXTS) + 1
    assert await results(store) == done


async def test_a_waiting_interactive_request_does_not_end_the_window(
    engine: LocalEngine, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = AdmissionGate(1)
    ctx = ServiceContext(engine=engine, gate=gate, rng=random.Random(0), store=store)
    rows = await claimed_batch(store, [body(t) for t in TEXTS], "t1")
    monkeypatch.setattr(packing, "runner_plan", lambda settings: lambda lengths: [[i] for i in range(len(lengths))])
    slot = await gate.acquire(Priority.BATCH)  # the chunk's slot, as the runner holds it
    waiter = asyncio.create_task(gate.acquire(Priority.INTERACTIVE))
    await until(lambda: gate.queue_length(Priority.INTERACTIVE), lambda n: n == 1, what="the chat queued at the gate")
    await window(ctx, store, rows, slot)
    # the engine's step scheduler admits interactive sequences beside the batch's: the window runs to its end
    assert len(await results(store)) == len(TEXTS)
    gate.release(slot)
    gate.release(await waiter)


async def test_a_cancel_ends_the_window_at_the_next_recorded_row(
    engine: LocalEngine, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)
    rows = await claimed_batch(store, [body(t) for t in TEXTS], "t1")
    monkeypatch.setattr(packing, "runner_plan", lambda settings: lambda lengths: [[i] for i in range(len(lengths))])
    async with store.tx() as conn:  # the cancel arrived while the window waited for its slot
        await sb.transition(conn, "batch_1", ("in_progress",), "cancelling", 3)
    await window(ctx, store, rows)
    assert len(await results(store)) == 1, "the first recorded row sees the cancel; the others stay pending"
    async with store.tx() as conn:
        assert await sr.count_pending(conn, "batch_1") == len(TEXTS) - 1
