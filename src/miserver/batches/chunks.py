"""The one row loop: run a claimed chunk of rows through its endpoint service and record each result exactly once.

Every batch row, packed or not, whatever the endpoint, passes through :func:`run_chunk`:

1. the chunk's rows go to the endpoint service's one many-rows call (``EndpointService.create_many``) with the
   batch's plan (``None``: each row alone, exactly the synchronous computation; a planner: length-aware packs);
2. each :class:`~miserver.services.many.Outcome` becomes an output or error line (:mod:`miserver.batches.output`)
   and is recorded in its own transaction, fenced by the claim token (a taken-over claim cannot record);
3. the rules that end a chunk early live once, in the ``should_stop`` the service asks before each row or pack:
   the runner is stopping, or a cancel or a pause arrived (read in the transaction of every record); and, once at
   least one row was recorded (a chunk always makes progress), the chunk's time bound (``BATCH_CHUNK_SECONDS``) is
   spent or an interactive request waits for the gate (interactive first, DESIGN §5). A row or pack that already started
   always finishes and is recorded. Batched generation keeps many rows in flight and asks before every decode step:
   all rules but the time bound (``Call.interrupt``) end it at once, dropping its rows in flight unrecorded (they
   stay pending); the time bound only stops new rows from starting while the rows in flight finish.

Rows left unrecorded stay pending; the caller releases the claim. Because the loop only consumes an async iterator of
outcomes, an executor that keeps several requests in flight (an upstream pool, batched generation) plugs into the
service side without a second loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import APIError, EngineUnavailableError
from ..scheduler import Priority, Slot
from ..services import billing
from ..services.context import Call, ServiceContext, ServiceResult
from ..services.many import Outcome, Plan
from ..services.registry import EndpointService
from ..store import Store
from ..store import batches as store_batches
from ..store import rows as store_rows
from ..store import usage as store_usage
from . import output

log = logging.getLogger("miserver.batches")


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
    return billing.result_model(outcome.result) if isinstance(outcome.result, ServiceResult) else ""


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
    yield_to_interactive: bool = True,
) -> ChunkReport:
    """Run ``rows`` (claimed under ``token``) while holding ``slot`` (None: each row or pack takes the admission gate
    itself), recording each as it finishes. ``endpoint`` (the batch's) picks the error body's dialect.

    ``time_limit`` is the chunk's time bound in seconds; ``stopping()`` answers true once the runner stops;
    ``deadline`` (Unix seconds, the batch's ``expires_at``) is when upstream rows stop being retried;
    ``yield_to_interactive`` false: the chunk does not end for interactive requests waiting at the resident gate
    (upstream rows pass their pool's gate one by one, where interactive requests go first). Returns
    a :class:`ChunkReport`; raises only for store faults (the rows then stay pending under the claim, which the
    caller releases).

    ``owner`` (the batch's key) pays for each successful row at ``prices`` (the batch's, fixed at its creation): the
    usage record is written in the transaction that records the row (:func:`~miserver.services.billing.row_usage`),
    and once a charge leaves the owner's balance at zero or below no further row or pack starts.
    """
    report = ChunkReport()
    started = time.monotonic()

    def interrupted() -> bool:  # the rules that also end work in flight (batched generation drops its rows)
        if stopping() or report.cancelled or report.paused or report.claim_lost or report.out_of_balance:
            return True
        if report.recorded == 0:
            return False  # a chunk always makes progress: its first row or pack runs
        return yield_to_interactive and ctx.gate.queue_length(Priority.INTERACTIVE) > 0

    def should_stop() -> bool:  # and the time bound: no new row or pack starts (rows in flight finish)
        return interrupted() or (report.recorded > 0 and time.monotonic() - started > time_limit)

    call = Call(
        strict=True,
        priority=Priority.BATCH,
        slot=slot,
        lease=lease,
        should_stop=should_stop,
        deadline=deadline,
        interrupt=interrupted,
    )
    bodies = [json.loads(r.body) for r in rows]
    outcomes = service.create_many(ctx, bodies, call, plan)
    try:
        async for outcome in outcomes:
            row = rows[outcome.index]
            ok, line, input_tokens, output_tokens = result_line(row.custom_id, outcome, endpoint)
            async with store.tx() as conn:
                recorded = await store_rows.record(
                    conn,
                    batch_id=batch_id,
                    line=row.line,
                    token=token,
                    ok=ok,
                    result=line,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                )
                status, paused = await store_batches.get_run_state(conn, batch_id)
                usage = (
                    billing.row_usage(
                        owner=owner,
                        prices=prices,
                        endpoint=endpoint,
                        batch_id=batch_id,
                        line=row.line,
                        model=outcome_model(outcome),
                        input_tokens=input_tokens,
                        output_tokens=output_tokens,
                    )
                    if recorded and ok
                    else None
                )
                if usage is not None and await store_usage.record_usage(conn, usage) and usage.cost:
                    balance = await store_usage.balance_of(conn, usage.key_id)
                    report.out_of_balance = balance is not None and balance <= 0
            if not recorded:
                log.warning("batch %s line %d: claim lost, result dropped", batch_id, row.line)
                report.claim_lost = True
                break
            report.recorded += 1
            report.tokens += input_tokens + output_tokens
            report.cancelled = status == "cancelling"
            report.paused = paused
            on_change(batch_id)
    except EngineUnavailableError:
        report.engine_unavailable = True  # not the row's fault: it stays pending and runs when the model is back
    finally:
        await outcomes.aclose()  # type: ignore[attr-defined]
    return report
