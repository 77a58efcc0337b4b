"""The one row loop: run a claimed chunk of rows through its endpoint service and record each result exactly once.

Every batch row, packed or not, whatever the endpoint, passes through :func:`run_chunk`:

1. the chunk's rows go to the endpoint service's one many-rows call (``EndpointService.create_many``) with the
   batch's plan (``None``: each row alone, exactly the synchronous computation; a planner: length-aware packs);
2. each :class:`~miserver.services.inference.many.Outcome` becomes an output or error line
(:mod:`miserver.batches.output`)
   and is recorded fenced by the claim token (a taken-over claim cannot record), with its usage, in one
   transaction. A chunk whose rows run concurrently (``read_ahead``: upstream pools) records together the outcomes
   that finish within a short window of each other (group commit, :func:`grouped`); otherwise each outcome is
   recorded before the next row starts;
3. the rules that end a chunk early live once, in the ``should_stop`` the service asks before each row or pack:
   the runner is stopping, a cancel or a pause arrived (read in the transaction of every record), the claim was
   lost, the balance ran out or the batch expired; and, once at least one row was recorded (a chunk always makes
   progress), the chunk's time bound (``BATCH_CHUNK_SECONDS``) is spent or the runner closed the chunk (a chunk the
   runner lets go on past its bound: ``resident_runs.ResidentRuns``). A waiting interactive request ends nothing:
   the engine's step scheduler starts it at the next decode step beside the rows in flight. A row or pack that
   already started always finishes and is recorded. Batched generation keeps many rows in flight and asks before
   every decode step: all rules but the time bound and the close (``Call.interrupt``) end it at once, dropping its
   rows in flight unrecorded (they stay pending); those two only stop new rows from starting while the rows in
   flight finish.

Rows left unrecorded stay pending; the caller releases the claim. Because the loop only consumes an async iterator of
outcomes, an executor that keeps several requests in flight (an upstream pool, batched generation) plugs into the
service side without a second loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ..clock import now
from ..errors import APIError, EngineUnavailableError
from ..scheduling.admission import Priority, Slot
from ..services.accounts.prices import row_usage
from ..services.inference.context import Call, ServiceContext, ServiceResult
from ..services.inference.many import Outcome, Plan
from ..services.inference.metering import result_model
from ..services.inference.registry import EndpointService
from ..store import Store
from ..store import rows as store_rows
from ..store import usage as store_usage
from . import output

log = logging.getLogger("miserver.batches")

#: Most outcomes recorded in one transaction by a read-ahead chunk (keeps each transaction short).
MAX_GROUP = 64
#: How long a read-ahead chunk's group stays open for more outcomes after its first (seconds). A record's transaction
#: costs about 2 ms of CPU on these machines whatever it holds (each statement is a round trip to the SQLite
#: thread), so at 4-16 rows in flight a quarter of a second lets several rows share one; rows are recorded at most
#: this much later, and a chunk's last rows are not held back (bench/gateway.py measures the effect).
GROUP_WINDOW_SECONDS = 0.25


@dataclass
class ChunkReport:
    """How a chunk ended: ``recorded`` rows (``tokens``: their prompt and completion tokens); ``cancelled`` when a
    cancel was seen; ``paused`` when a pause was seen; ``claim_lost`` when a record was
    refused (the claim was taken over); ``engine_unavailable`` when the engine could not take a row (it stays
    pending)."""

    recorded: int = 0
    tokens: int = 0
    cancelled: bool = False
    paused: bool = False
    claim_lost: bool = False
    engine_unavailable: bool = False
    #: a recorded row's charge used up the batch owner's balance (the chunk stops there)
    out_of_balance: bool = False


def result_line(custom_id: str, outcome: Outcome, endpoint: str = "") -> tuple[bool, str, int, int]:
    """``(ok, line, input_tokens, output_tokens)`` of a row's outcome: its output line, or its error line (the
    synchronous route's status and body, in the dialect of ``endpoint``). Usage counts only for rows that
    succeeded."""
    if isinstance(outcome.result, APIError):
        return False, output.failure_line(custom_id, outcome.result, endpoint), 0, 0
    result = outcome.result
    line = output.success_line(custom_id, result, packed=outcome.packed)
    return True, line, result.prompt_tokens, result.completion_tokens


def outcome_model(outcome: Outcome) -> str:
    """The model that answered a successful outcome (its ``X-miLLM-Model`` header)."""
    return result_model(outcome.result) if isinstance(outcome.result, ServiceResult) else ""


async def one_by_one(outcomes: AsyncIterator[Outcome]) -> AsyncIterator[list[Outcome]]:
    """Each outcome as a group of its own; the next is asked for only once the caller is done with this one (so
    no further row starts before a row is recorded). Closing the groups closes ``outcomes``."""
    try:
        async for outcome in outcomes:
            yield [outcome]
    finally:
        await outcomes.aclose()  # type: ignore[attr-defined]


async def grouped(
    outcomes: AsyncIterator[Outcome], limit: int = MAX_GROUP, window: float = GROUP_WINDOW_SECONDS
) -> AsyncIterator[list[Outcome]]:
    """The outcomes in groups of at most ``limit``, each recorded in one transaction by the caller (group commit).

    A group starts with the next outcome to finish and takes every further outcome that finishes within ``window``
    seconds of it (or had already finished, while the caller was busy with the previous group); it closes early once
    it holds ``limit`` outcomes or ``outcomes`` has ended, so the last rows of a chunk are not held back. The outcomes
    are read by a task of their own meanwhile. An exception of ``outcomes`` is raised after every outcome that came
    before it was yielded; closing the groups closes ``outcomes``."""
    queue: asyncio.Queue[Outcome | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for outcome in outcomes:
                queue.put_nowait(outcome)
        except BaseException as exc:  # handed to the consumer, which never waits for an end that cannot come
            queue.put_nowait(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            queue.put_nowait(None)

    loop = asyncio.get_running_loop()
    task = asyncio.create_task(pump(), name="miserver-chunk-outcomes")
    try:
        end: BaseException | None = None
        ended = False
        while not ended:
            group: list[Outcome] = []
            item = await queue.get()
            closes = loop.time() + window
            while True:
                if isinstance(item, Outcome):
                    group.append(item)
                else:
                    ended, end = True, item
                    break
                if len(group) >= limit:
                    break
                if queue.empty():
                    left = closes - loop.time()
                    if left <= 0:
                        break
                    try:
                        async with asyncio.timeout(left):
                            item = await queue.get()
                    except TimeoutError:
                        break
                else:
                    item = queue.get_nowait()
            if group:
                yield group
        if end is not None:
            raise end
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await outcomes.aclose()  # type: ignore[attr-defined]


async def run_chunk(
    *,
    ctx: ServiceContext,
    store: Store,
    service: EndpointService,
    endpoint: str = "",
    batch_id: str,
    token: str,
    rows: Sequence[store_rows.ClaimedRow],
    plan: Plan | None,
    slot: Slot | None,
    lease: str | None,
    time_limit: float,
    stopping: Callable[[], bool],
    on_change: Callable[[str], None],
    owner: str | None = None,
    prices: dict[str, list[int]] | None = None,
    deadline: float | None = None,
    read_ahead: bool = False,
    closed: Callable[[], bool] | None = None,
) -> ChunkReport:
    """Run ``rows`` (claimed under ``token``) while holding ``slot`` (None: each row or pack takes the admission gate
    itself), recording each as it finishes. ``endpoint`` (the batch's) picks the error body's dialect.

    ``time_limit`` is the chunk's time bound in seconds; ``closed()`` (when given) answers true once the runner
    closes the chunk, which ends it as the time bound does (no new row starts; the rows in flight finish and are
    recorded); ``stopping()`` answers true once the runner stops;
    ``deadline`` (Unix seconds, the batch's ``expires_at``) is when rows stop: upstream rows are no longer retried and
    rows in flight on the resident engine leave at its next step; ``read_ahead``: the
    service's rows run concurrently (upstream pools), so outcomes that finish close together are recorded in one
    transaction (:func:`grouped`). Returns a :class:`ChunkReport`; raises only for store faults
    (the rows then stay pending under the claim, which the caller releases).

    ``owner`` (the batch's key) pays for each successful row at ``prices`` (the batch's, fixed at its creation): the
    usage record is written in the transaction that records the row
    (:func:`~miserver.services.accounts.row_usage`),
    and once a charge leaves the owner's balance at zero or below no further row or pack starts.
    """
    report = ChunkReport()
    started = time.monotonic()

    def interrupted() -> bool:  # the rules that also end work in flight (the engine drops its rows at the next step)
        if stopping() or report.cancelled or report.paused or report.claim_lost or report.out_of_balance:
            return True
        return deadline is not None and now() >= deadline

    def time_up() -> bool:
        return time.monotonic() - started > time_limit or (closed is not None and closed())

    def should_stop() -> bool:  # and the time bound: no new row or pack starts (rows in flight finish)
        return interrupted() or (report.recorded > 0 and time_up())

    call = Call(
        strict=True,
        priority=Priority.BATCH,
        slot=slot,
        lease=lease,
        should_stop=should_stop,
        deadline=deadline,
        interrupt=interrupted,
        time_up=time_up,
        fairness_key=batch_id,
        invariant=plan is None,  # rows that do not pack run alone, exactly as the synchronous route computes them
    )
    bodies = [json.loads(r.body) for r in rows]
    outcomes = service.create_many(ctx, bodies, call, plan)
    groups = grouped(outcomes) if read_ahead else one_by_one(outcomes)
    try:
        async for group in groups:
            await _record(
                store,
                report,
                group,
                rows,
                batch_id=batch_id,
                token=token,
                endpoint=endpoint,
                owner=owner,
                prices=prices,
            )
            if report.claim_lost:
                break
            on_change(batch_id)
    except EngineUnavailableError:
        report.engine_unavailable = True  # not the row's fault: it stays pending and runs when the model is back
    finally:
        await groups.aclose()  # type: ignore[attr-defined]
        await outcomes.aclose()  # type: ignore[attr-defined]  # (when the groups never started)
    return report


async def _record(
    store: Store,
    report: ChunkReport,
    group: list[Outcome],
    rows: Sequence[store_rows.ClaimedRow],
    *,
    batch_id: str,
    token: str,
    endpoint: str,
    owner: str | None,
    prices: dict[str, list[int]] | None,
) -> None:
    """Record ``group`` in one transaction (each row fenced by ``token``, each successful row's usage with it) and
    fold what happened into ``report``: rows recorded, a cancel or pause seen, the owner's balance used up, a claim
    lost (a row that could not be recorded: its result is dropped and the chunk ends)."""
    results: list[store_rows.RowResult] = []
    models: dict[int, str] = {}
    for outcome in group:
        row = rows[outcome.index]
        ok, line, input_tokens, output_tokens = result_line(row.custom_id, outcome, endpoint)
        results.append(store_rows.RowResult(row.line, ok, line, input_tokens, output_tokens))
        models[row.line] = outcome_model(outcome)
    async with store.tx() as conn:
        recorded = await store_rows.record_many(conn, batch_id=batch_id, token=token, results=results)
        charged = False
        for r in results:
            if not r.ok or r.line not in recorded.lines:
                continue
            usage = row_usage(
                owner=owner,
                prices=prices,
                endpoint=endpoint,
                batch_id=batch_id,
                line=r.line,
                model=models[r.line],
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
            )
            if usage is not None and await store_usage.record_usage(conn, usage) and usage.cost:
                charged = True
        if charged and owner is not None:
            balance = await store_usage.balance_of(conn, owner)
            report.out_of_balance = balance is not None and balance <= 0
    for r in results:
        if r.line in recorded.lines:
            report.recorded += 1
            report.tokens += r.input_tokens + r.output_tokens
    lost = [r.line for r in results if r.line not in recorded.lines]
    if lost:
        log.warning("batch %s lines %s: claim lost, results dropped", batch_id, lost)
        report.claim_lost = True
    report.cancelled = recorded.status == "cancelling"
    report.paused = recorded.paused
