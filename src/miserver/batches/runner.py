"""The batch runner: drives every non-terminal batch to a terminal status.

One loop per process. Each pass lists the active batches in creation order and advances each one from a fresh read
of its record: a ``validating`` batch gets a validation task (:class:`~miserver.batches.validate.Validator`), an
``in_progress`` batch one chunk (round robin: claim up to ``BATCH_CHUNK_ROWS`` rows, or a packing window, take one
admission slot at batch priority and run the chunk through the one row loop, :func:`~miserver.batches.chunks.
run_chunk`), a ``finalizing``, ``cancelling`` or expired batch its files (:func:`~miserver.batches.output.finish`).
Between chunks it sees cancels, expiry and new batches. Every write is a guarded statement of ``store/`` that raises
when the batch moved on, so nothing a pass does can rest on a stale read. File pruning runs as its own task
(:mod:`miserver.jobs`, started by the runtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from ..clock import now, now_ms
from ..scheduling import policy as scheduling
from ..scheduling.admission import Priority
from ..services.accounts import keys as accounts
from ..services.accounts.balance import batch_verdict
from ..services.inference.context import ServiceContext
from ..settings import Settings
from ..store import Store
from ..store import batch_states as states
from ..store import batches as store_batches
from ..store import fair_share as store_fair
from ..store import keys as store_keys
from ..store import model_life as store_models
from ..store import operations as store_operations
from ..store import rows as store_rows
from ..store.batches import BatchRecord, StaleStatus
from . import estimates, fair_turns, output
from .readiness import Readiness, readiness, release_lease_of_finished, release_own_lease
from .resident_runs import ResidentRuns
from .run_state import RunState
from .upstream_runs import UpstreamRuns
from .validate import BatchFailure, Validator

log = logging.getLogger("miserver.batches")

#: Interactive traffic counts as present (``MISERVER_BATCH_SHARE``) for this long after a request was admitted.
INTERACTIVE_RECENT_SECONDS = 10.0

#: The statuses whose step is short enough for the quick pass (a validation task starts, a finish is written).
QUICK_STATUSES = ("validating", "cancelling")

SERVER_VALIDATION_ERROR: dict[str, object] = {
    "code": "server_error",
    "message": "Validation failed on the server.",
    "param": None,
    "line": None,
}


class BatchRunner:
    """Drives every non-terminal batch to a terminal status. ``run()`` until ``stop()``."""

    def __init__(
        self,
        store: Store,
        ctx: ServiceContext,
        settings: Settings,
        *,
        worker_id: str | None = None,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.ctx = ctx
        self.settings = settings
        self.worker_id = worker_id or f"worker-{secrets.token_hex(4)}"
        self.on_change = on_change or (lambda _id: None)
        self.validator = Validator(store, ctx, settings, self.worker_id)
        self._wake = asyncio.Event()
        self._kick = asyncio.Event()
        #: What this runner shares with its upstream chunks: claims, heartbeats, waiting reasons, the stop flag.
        self.state = RunState(store, ctx, settings, self.worker_id, self.on_change, self.wake)
        #: The batch whose chunk this process is running now (the quick pass leaves it to the chunk loop).
        self._chunk_batch: str | None = None
        #: Validation tasks running in this process, by batch id (a finished task removes itself).
        self._validations: dict[str, asyncio.Task[None]] = {}
        #: Chunks of batches whose rows go to upstream pools (gateway mode), run as tasks beside each other.
        self.upstream = UpstreamRuns(self.state)
        #: The scheduling policy's inputs: batch hours, the deadline margin, a newcomer's head start in fair share
        #: per worker running chunks (rows: two chunks; the counts themselves are the database's, shared by every
        #: worker), the clock (Unix seconds; miServer's injectable clock), and when interactive requests were last
        #: admitted.
        self.hours = scheduling.BatchHours.parse(settings.batch_hours, settings.batch_hours_timezone)
        self.margin = scheduling.Margin(fraction=settings.batch_deadline_margin)
        self.credit_rows = 2 * settings.batch_chunk_rows
        self.clock: Callable[[], float] = lambda: now_ms() / 1000
        self._interactive_seen: tuple[int, float] = (0, float("-inf"))
        self._halt = asyncio.Event()
        #: Chunks of batches on the resident model, one at a time, or the next of a batch beside its last one past
        #: its time bound (their last chunk feeds the batch share).
        self.resident = ResidentRuns(self.state)

    def wake(self) -> None:
        """Ask the loop to look at the batches now (a batch was created or cancelled): a new batch starts validating
        and a cancelled one is finished at once, even while another batch's chunk runs (:meth:`quick_pass`)."""
        self._wake.set()
        self._kick.set()

    @property
    def _stopping(self) -> bool:
        return self.state.stopping

    def stop(self) -> None:
        """Graceful stop: the current row finishes and is recorded, then the loop returns."""
        self.state.stopping = True
        self._wake.set()
        self._halt.set()

    async def run(self) -> None:
        """Release this process's stale claims, then advance batches until :meth:`stop`."""
        async with self.store.tx() as conn:
            if self.store.is_sqlite:
                await store_rows.release_all_claims(conn)
            else:
                await store_rows.release_claims_of(conn, self.worker_id)
        quick = asyncio.create_task(self._quick_passes(), name="miserver-batch-quick-pass")
        try:
            while not self._stopping:
                self._wake.clear()  # before the step: a wake during the step (a chunk task ended) is kept
                busy = await self.step()
                if not busy and not self._stopping:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.settings.batch_poll_seconds)
        finally:
            await self.upstream.drain()
            try:
                await self.resident.settle()  # a chunk finishing in the background records its rows in flight
            except Exception:
                log.exception("a resident chunk failed while the runner stopped")
            tasks = [quick, *self._validations.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def step(self) -> bool:
        """One pass over the active batches; True when it ran or finished something.

        Every batch but the running ones takes its own step (validation, finish, expiry); then the scheduling policy
        (:mod:`~miserver.scheduling.policy`) picks which running batch gets the next chunk."""
        async with self.store.tx() as conn:
            snapshot = await store_batches.active_batches(conn)
        release_lease_of_finished(self.ctx, {b.id for b in snapshot})
        busy = False
        running: list[BatchRecord] = []
        for batch in snapshot:
            if self._stopping:
                break
            if batch.status == "in_progress" and self.clock() < batch.expires_at:
                running.append(batch)
                continue
            try:
                busy |= await self.advance(batch.id)
            except StaleStatus as exc:  # the batch moved on under this pass: the next pass reads it again
                log.info("%s", exc)
                busy = True
            except Exception:  # a fault of one batch must not stop the others
                log.exception("batch %s: runner error", batch.id)
        if running and not self._stopping:
            try:
                busy |= await self._run_next(running)
            except StaleStatus as exc:
                log.info("%s", exc)
                busy = True
        return busy

    # -- scheduling --------------------------------------------------------------------------------

    async def _run_next(self, running: list[BatchRecord]) -> bool:
        """Plan the running batches (:func:`~miserver.scheduling.policy.plan`), store their ETAs and waiting
        reasons, let each runnable batch of an upstream pool take its step, and run one chunk on the resident engine
        for the first resident batch in the plan's order that is ready."""
        async with self.store.tx() as conn:
            pending = await store_operations.pending_by_batch(conn, [b.id for b in running])
            rates = await store_operations.rates(conn)
        by_id = {b.id: b for b in running}
        candidates = [_candidate(b, pending.get(b.id, 0)) for b in running]

        def rate_of(c: scheduling.Candidate) -> float | None:
            b = by_id[c.id]
            rate = rates.get((b.model or "", b.endpoint))
            return rate.rows_per_second if rate is not None else None

        fair = await self._fair_share(candidates)
        decision = scheduling.plan(
            candidates, now=self.clock(), rate_of=rate_of, fair=fair, hours=self.hours, margin=self.margin
        )
        await estimates.store_estimates(self.store, running, decision, pending, self.clock(), self.upstream.serves)
        if self.resident.background() not in (None, *decision.order):
            self.resident.close()  # the plan no longer runs that batch now: its chunk ends as at its time bound
        for batch_id, reason in decision.waiting.items():
            await self.state.set_waiting(by_id[batch_id], reason, None)
        # batches whose rows go to upstream pools do not share the resident engine: each takes its step
        upstream = [b for b in decision.order if self.upstream.serves(by_id[b])]
        busy = False
        for batch_id in upstream:
            busy |= await self._advance_running(by_id[batch_id])
        for batch_id in decision.order:
            batch = by_id[batch_id]
            if batch_id in upstream:
                continue
            if await self._advance_running(batch, take_over=True, overlap=True):  # its claim charged its share
                for other in decision.order:
                    if other != batch_id and other in decision.queued:
                        await self.state.set_waiting(by_id[other], "queued", None)
                await self._yield_share()
                return True
        return busy

    async def _fair_share(self, candidates: list[scheduling.Candidate]) -> scheduling.FairShare:
        """The fair-share counts every worker on the database shares (see :func:`fair_turns.shared_counts`)."""
        return await fair_turns.shared_counts(
            self.store, candidates, worker_id=self.worker_id, credit_rows=self.credit_rows
        )

    async def _yield_share(self) -> None:
        """With ``MISERVER_BATCH_SHARE`` below 1, while interactive requests keep arriving (one admitted in the last
        10 s), leave the engine idle after a chunk long enough that batches take at most that share of its time."""
        share = self.settings.batch_share
        granted = self.ctx.gate.granted[Priority.INTERACTIVE]
        clock = time.monotonic()
        if granted != self._interactive_seen[0]:
            self._interactive_seen = (granted, clock)
        if share >= 1.0 or clock - self._interactive_seen[1] > INTERACTIVE_RECENT_SECONDS:
            return
        await self.resident.settle()  # no batch row runs while the engine is left idle
        idle = self.resident.last_chunk_seconds * (1.0 / share - 1.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._halt.wait(), idle)

    async def _quick_passes(self) -> None:
        while not self._stopping:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.quick_pass()
            except Exception:
                log.exception("quick pass failed")

    async def quick_pass(self) -> None:
        """Advance the ``validating`` and ``cancelling`` batches now, without waiting for the chunk loop to reach
        them: their steps are short (a validation runs as its own task; a finish writes the files), so a create or a
        cancel is seen at once even while another batch's chunk runs. A batch whose chunk runs here is left to it."""
        async with self.store.tx() as conn:
            active = await store_batches.active_batches(conn)
        for batch in active:
            if batch.status not in QUICK_STATUSES or self._chunk_runs(batch.id):
                continue
            try:
                await self.advance(batch.id, only=QUICK_STATUSES)
            except StaleStatus as exc:
                log.info("%s", exc)
            except Exception:
                log.exception("batch %s: runner error", batch.id)

    async def advance(self, batch_id: str, *, only: tuple[str, ...] | None = None) -> bool:
        """Advance one batch by one step, from a fresh read of its record; True when it ran or finished something.

        ``only`` limits the step to batches in those statuses as read now (the quick pass never runs a chunk)."""
        async with self.store.tx() as conn:
            batch = await store_batches.get_batch(conn, batch_id)
        if batch is None or batch.terminal:
            return False
        if only is not None and (batch.status not in only or self._chunk_runs(batch.id)):
            return False  # a quick step only, never beside this process's own chunk of the batch
        if batch.status == "validating":
            if batch.id not in self._validations:
                self._start_validation(batch)
            return False
        if batch.status == "cancelling":
            if batch.id in self._validations or store_batches.validation_live(
                batch, worker=self.worker_id, now_ms=now_ms()
            ):
                return False  # a validation (here or in another process) is reading the file to its end first
            if store_batches.needs_validation(batch):
                self._start_validation(batch)  # cancelled before its validation finished: account for every line
                return False
            return await self._finish(batch, "cancelled", "batch_cancelled")
        if batch.status == "finalizing":
            return await self._finish(batch, "completed", None)
        if batch.status == "in_progress":
            await self._fair_share([_candidate(batch, 0)])  # a chunk run outside a plan charges its share too
            return await self._advance_running(batch)
        return False

    async def _advance_running(self, batch: BatchRecord, *, take_over: bool = False, overlap: bool = False) -> bool:
        """An ``in_progress`` batch's step: expire it, or run one chunk when it is ready (else store why it waits).
        ``take_over``: the scheduler picked it, so it takes the model lease from another batch that holds it between
        chunks (fair share); ``overlap``: a resident chunk returns once past its time bound and finishes in the
        background (:meth:`ResidentRuns.claim_and_run`)."""
        await self.resident.settle(keep=batch.id)  # another batch's chunk in the background is closed and ends first
        if now() >= batch.expires_at:
            return await self._finish(batch, "expired", "batch_expired")
        if batch.paused_at is not None:
            await self.state.set_waiting(batch, "paused", None)
            return False
        if batch.owner_key_id is not None:
            held = await self._account_hold(batch)
            if held is not None:
                return held
        if self.upstream.serves(batch):  # gateway mode: its rows go to upstream pools, no resident rules
            return await self.upstream.advance(batch)
        async with self.store.tx() as conn:
            torn = await store_models.weights_torn(conn, batch.model or "")
        ready = readiness(
            self.ctx,
            batch,
            weights_torn=torn,
            lease_ttl_seconds=self.settings.batch_lease_ttl_seconds,
            take_over=take_over,
        )
        if ready.waiting_reason is not None:
            await self.state.set_waiting(batch, ready.waiting_reason, None)
            return False
        return await self._run_chunk(batch, ready, overlap)

    async def _account_hold(self, batch: BatchRecord) -> bool | None:
        """The owner key's say before each chunk, from a fresh read of the key: None to go on; else the
        step's answer after ending the batch ``failed`` (key revoked; balance used up past the grace: unrun rows
        become ``key_revoked``/``insufficient_quota`` error lines, uncharged) or marking it ``insufficient_balance``."""
        assert batch.owner_key_id is not None
        async with self.store.tx() as conn:
            key = await store_keys.get_key(conn, batch.owner_key_id)
        verdict = batch_verdict(key, batch, now=now(), grace_seconds=self.settings.balance_grace_seconds)
        if verdict.fail is not None:
            return await self._finish(batch, "failed", verdict.fail.code, errors=[verdict.fail.as_batch_error()])
        if verdict.waiting:
            if batch.balance_waiting_since is None or batch.waiting_reason != "insufficient_balance":
                async with self.store.tx() as conn:
                    await store_batches.set_fields(
                        conn,
                        batch.id,
                        ("in_progress",),
                        waiting_reason="insufficient_balance",
                        lease_holder=None,
                        balance_waiting_since=batch.balance_waiting_since or now(),
                    )
                self.on_change(batch.id)
            return False
        if batch.balance_waiting_since is not None:  # topped up during the grace: it goes on
            async with self.store.tx() as conn:
                await store_batches.set_fields(conn, batch.id, ("in_progress",), balance_waiting_since=None)
        return None

    # -- validation -------------------------------------------------------------------------------------------

    def _start_validation(self, batch: BatchRecord) -> None:
        task = asyncio.create_task(self._validate(batch), name=f"miserver-validate-{batch.id}")
        self._validations[batch.id] = task
        task.add_done_callback(lambda _t: self._validations.pop(batch.id, None))

    async def _validate(self, batch: BatchRecord) -> None:
        try:
            with accounts.acting_as(accounts.owner_principal(batch.owner_key_id)):  # its lines see what it sees
                if not await self.validator.run(batch):
                    return  # another live process validates it
        except BatchFailure as failure:
            await self._fail_validation(batch.id, failure.as_batch_error())
        except StaleStatus as exc:  # cancelled while validating, or the claim was taken over
            log.info("batch %s: validation stopped: %s", batch.id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: validation error", batch.id)
            await self._fail_validation(batch.id, SERVER_VALIDATION_ERROR)
        self.on_change(batch.id)
        self.wake()

    async def _fail_validation(self, batch_id: str, error: dict[str, object]) -> None:
        """``validating`` -> ``failed`` with ``error``, while this process still holds the validation claim."""
        async with self.store.tx() as conn:
            status = await store_batches.hold_validation(
                conn, batch_id, worker=self.worker_id, now_ms=now_ms(), ttl_ms=self.state.claim_ttl_ms
            )
            if status != "validating":  # cancelled meanwhile: the cancel wins, the runner finishes it as cancelled
                await store_batches.set_fields(
                    conn, batch_id, (status,), errors=[error], claimed_by=None, claimed_until=None
                )
                return
            await store_batches.transition(
                conn, batch_id, ("validating",), "failed", now(), errors=[error], claimed_by=None, claimed_until=None
            )

    # -- running ----------------------------------------------------------------------------------------------

    async def _run_chunk(self, batch: BatchRecord, ready: Readiness, overlap: bool) -> bool:
        self._chunk_batch = batch.id
        try:
            return await self.resident.claim_and_run(batch, ready, overlap=overlap)
        finally:
            self._chunk_batch = None

    def _chunk_runs(self, batch_id: str) -> bool:
        """Whether a resident chunk of the batch runs in this process now (in the foreground or finishing in the
        background)."""
        return batch_id == self._chunk_batch or self.resident.running(batch_id)

    # -- finishing --------------------------------------------------------------------------------------------

    async def _finish(
        self, batch: BatchRecord, to: str, unrun_code: str | None, errors: list[dict[str, object]] | None = None
    ) -> bool:
        """Write ``batch``'s files and move it to ``to`` (``failed`` here only from ``in_progress``: the owner's key
        stopped it, with ``errors``)."""
        if self.upstream.running(batch.id) or self.resident.running(batch.id):
            return False  # its chunks finish (and record) what is in flight first; their end wakes the loop
        allowed = {"completed": ("finalizing",), "failed": ("in_progress",)}.get(to) or states.sources(to)
        try:
            async with self.store.tx() as conn:
                await output.finish(
                    conn,
                    batch,
                    allowed=allowed,
                    to=to,
                    unrun_code=unrun_code,
                    file_expiry_seconds=self.settings.file_default_expiry_seconds,
                    extra={"errors": errors} if errors is not None else None,
                )
        except output.StatusMoved:
            return True  # e.g. cancelled while finalizing: the next pass finishes it as cancelled
        release_own_lease(self.ctx, batch.id)
        self.upstream.forget(batch.id)
        self.on_change(batch.id)
        return True


def _candidate(b: BatchRecord, pending: int) -> scheduling.Candidate:
    """``b`` as the scheduling policy sees it, with its ``pending`` rows."""
    return scheduling.Candidate(
        id=b.id,
        priority=b.priority,
        created_at=b.created_at,
        expires_at=b.expires_at,
        pending=pending,
        owner=store_fair.owner_key(b.owner_key_id, b.id),
        paused=b.paused_at is not None,
    )
