"""Batched generation in the one row loop (``batches.chunks.run_chunk``) on a ``pack: true`` window, on SQLite and
PostgreSQL, with the tiny model: generation rows decode together and say ``packed: true``, each row gets what it
asked for (same text as ``pack: false`` at temperature 0), a short row is recorded before a long one that started
with it, and an interactive request joins the decode at the next step without ending it or dropping a row.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from miserver.batches import chunks, packing
from miserver.engines.base import GenerationRequest
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.scheduler import Group, Ticket
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference.context import Call, ServiceContext
from miserver.services.inference.registry import SERVICES
from miserver.settings import Settings
from miserver.store import Store
from miserver.store import rows as sr
from tests.integration.test_packing_window import claimed_batch, results

SETTINGS = Settings(batch_generate_slots=3)


def body(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


BODIES = [
    body("tell me about the sea", 16),
    body("hi", 2),
    body("why is the sky blue?", 6, logprobs=True, top_logprobs=2),
    body("x " * 600, 4),  # longer than the context: fails alone, as the synchronous route answers it
    body("count to ten", 5, n=2, temperature=0.9, seed=3),
    body("one word", 1),  # a scoring row: it packs as before
]


async def run_window(
    ctx: ServiceContext, store: Store, rows: list[sr.ClaimedRow], plan: Any, order: list[str], **kwargs: Any
) -> chunks.ChunkReport:
    options: dict[str, Any] = {"slot": None, "time_limit": 3600, **kwargs}
    return await chunks.run_chunk(
        ctx=ctx,
        store=store,
        service=SERVICES["/v1/chat/completions"],
        batch_id="batch_1",
        token="t1",
        rows=rows,
        plan=plan,
        lease=None,
        stopping=lambda: False,
        on_change=lambda _id: None,
        **options,
    )


@pytest.fixture
def recorded_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """custom_ids in the order their lines are built for recording."""
    order: list[str] = []
    real = chunks.result_line

    def spy(custom_id: str, *args: Any, **kwargs: Any) -> Any:
        order.append(custom_id)
        return real(custom_id, *args, **kwargs)

    monkeypatch.setattr(chunks, "result_line", spy)
    return order


async def test_generation_rows_decode_together(engine: LocalEngine, store: Store, recorded_order: list[str]) -> None:
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)
    rows = await claimed_batch(store, BODIES, "t1")
    singles = {}
    for i, b in enumerate(BODIES):  # pack: false, the synchronous computation
        try:
            singles[f"r{i}"] = (
                await SERVICES["/v1/chat/completions"].create(ctx, b, Call(strict=True, priority=Priority.BATCH))
            ).body  # type: ignore[union-attr]
        except Exception as exc:  # the over-long row
            singles[f"r{i}"] = {"error": str(exc)}
    before = engine.executions
    report = await run_window(ctx, store, rows, packing.runner_plan(SETTINGS), recorded_order)
    assert report.recorded == len(BODIES)
    assert engine.executions - before == len(BODIES) - 1  # the over-long row never reaches the engine
    done = await results(store)
    packed = {cid: line["response"].get("millm", {}).get("packed") for cid, line in done.items()}
    assert packed == {"r0": True, "r1": True, "r2": True, "r3": None, "r4": True, "r5": False}
    assert done["r3"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    for cid in ("r0", "r1", "r2", "r4", "r5"):
        got, want = done[cid]["response"]["body"], singles[cid]
        assert [c["message"]["content"] for c in got["choices"]] == [c["message"]["content"] for c in want["choices"]]
        assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want["choices"]]
        assert got["usage"] == want["usage"]
    tokens = [t["token"] for t in done["r2"]["response"]["body"]["choices"][0]["logprobs"]["content"]]
    assert tokens == [t["token"] for t in singles["r2"]["choices"][0]["logprobs"]["content"]]
    # r1 (2 tokens) leaves long before r0 (16 tokens) that started beside it; refused and scoring rows come first
    assert recorded_order.index("r1") < recorded_order.index("r0")
    assert recorded_order[-1] == "r0"


async def test_an_interactive_request_joins_the_packed_decode_at_the_next_step(
    engine: LocalEngine, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = AdmissionGate(4)  # wide, as the resident engine's: the step scheduler admits each sequence
    ctx = ServiceContext(engine=engine, gate=gate, rng=random.Random(0), store=store)
    bodies = [body("hi", 2), body("tell me about the sea", 20), body("and the ships", 20), body("ok", 3)]
    rows = await claimed_batch(store, bodies, "t1")
    slot = await gate.acquire(Priority.BATCH)  # the chunk's slot, as the runner holds it
    chat: list[asyncio.Task[Any]] = []

    def on_record(_custom_id: str) -> None:  # an interactive request arrives once the first row is recorded
        if not chat:
            call = Call(strict=True)
            chat.append(asyncio.create_task(SERVICES["/v1/chat/completions"].create(ctx, body("yo", 2), call)))

    real = chunks.result_line

    def spy(custom_id: str, *args: Any, **kwargs: Any) -> Any:
        on_record(custom_id)
        return real(custom_id, *args, **kwargs)

    monkeypatch.setattr(chunks, "result_line", spy)
    submitted: list[int] = []  # the steps done when each interactive request reached the scheduler
    submit = engine.scheduler.submit

    def arrive(request: GenerationRequest, group: Group | None = None) -> Ticket:
        if request.priority == Priority.INTERACTIVE:
            submitted.append(engine.scheduler.steps)
        return submit(request, group)

    monkeypatch.setattr(engine.scheduler, "submit", arrive)
    admitted: list[tuple[int, int]] = []  # (step, batch sequences in flight) as each interactive request starts
    count = engine.scheduler.on_start

    def watch(request: Any) -> None:
        if request.priority == Priority.INTERACTIVE:
            admitted.append((engine.scheduler.steps, engine.scheduler.in_flight))
        assert count is not None
        count(request)

    monkeypatch.setattr(engine.scheduler, "on_start", watch)
    before = engine.executions
    report = await run_window(ctx, store, rows, packing.runner_plan(SETTINGS), [], slot=slot)
    gate.release(slot)
    answer = await chat[0]
    assert report.recorded == 4, "no batch row is dropped or ended for the interactive request"
    assert engine.executions - before == 5, "each row once, and the interactive request"
    assert len(submitted) == len(admitted) == 1
    (step, beside) = admitted[0]
    # it reached the scheduler while step k ran (k steps done) and starts at step k + 1, not after a row's end
    assert step == submitted[0] + 1, f"admitted at the next step: arrived after {submitted[0]} steps, began at {step}"
    assert beside >= 1, "it joined while batch rows were in flight"
    assert answer.status_code == 200 and answer.headers["X-miLLM-Batch-Invariant"] == "false"
    done = await results(store)
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert all(line["response"]["status_code"] == 200 for line in done.values())


async def test_the_time_bound_lets_the_rows_in_flight_finish(engine: LocalEngine, store: Store) -> None:
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)
    bodies = [body("hi", 2), body("tell me about the sea", 8), body("and the ships", 8), body("ok", 3)]
    rows = await claimed_batch(store, bodies, "t1")
    before = engine.executions
    # The time bound is spent as soon as the first row is recorded: no new row starts, the two in flight finish.
    report = await run_window(ctx, store, rows, packing.runner_plan(SETTINGS), [], time_limit=0.0)
    assert report.recorded == 3 and engine.executions - before == 3
    assert sorted(await results(store)) == ["r0", "r1", "r2"]
    async with store.tx() as conn:
        assert await sr.count_pending(conn, "batch_1") == 1
