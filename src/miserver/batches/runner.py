"""The batch runner: validates new batches, runs rows in chunks through the services, finishes batches.

One loop per process. Each pass walks the active batches in creation order and gives each in-progress batch one
chunk (round robin): claim up to ``BATCH_CHUNK_ROWS`` rows, take one admission slot at batch priority, run the rows
through the SAME service function as the synchronous route, record each result in its own transaction (exactly
once, fenced by the claim token), give the slot back. Between chunks it sees cancels, expiry and new batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

from ..errors import SERVER_ERROR_MESSAGE, APIError, EngineUnavailableError, ServerError
from ..ids import now, now_ms
from ..scheduler import Priority
from ..services.context import Call, ServiceContext, ServiceResult
from ..services.registry import SERVICES, EndpointService
from ..settings import Settings
from ..store import Store
from ..store import batches as store_batches
from ..store import files as store_files
from ..store import models as store_models
from ..store import rows as store_rows
from ..store.batches import BatchRecord
from . import output, packing, states
from .readiness import Readiness, foreign_lease_holder, readiness, release_own_lease
from .validate import MAX_LISTED_ERRORS, BatchFailure, check_line, error_line, physical_lines

log = logging.getLogger("miserver.batches")

INSERT_PAGE = 500


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
        self.claim_ttl_ms = int(settings.batch_claim_ttl_seconds * 1000)
        self._wake = asyncio.Event()
        self._stopping = False
        self._validations: dict[str, asyncio.Task[None]] = {}
        self._next_prune = 0.0

    def wake(self) -> None:
        """Ask the loop to look at the batches now (a batch was created or cancelled)."""
        self._wake.set()

    def stop(self) -> None:
        """Graceful stop: the current row finishes and is recorded, then the loop returns."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        async with self.store.tx() as conn:
            if self.store.is_sqlite:
                await store_rows.release_all_claims(conn)
            else:
                await store_rows.release_claims_of(conn, self.worker_id)
        try:
            while not self._stopping:
                busy = await self.step()
                if not busy and not self._stopping:
                    self._wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.settings.batch_poll_seconds)
        finally:
            for task in self._validations.values():
                task.cancel()
            await asyncio.gather(*self._validations.values(), return_exceptions=True)

    async def prune(self) -> list[str]:
        """Delete the bytes of expired files no running batch needs (DESIGN §6); returns the file ids."""
        async with self.store.tx() as conn:
            pruned = await store_files.prune_expired_content(conn, now())
        if pruned:
            log.info("pruned the content of %d expired files", len(pruned))
        return pruned

    async def step(self) -> bool:
        """One pass over the active batches; True when it ran or finished something."""
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self.settings.file_prune_interval_seconds
            try:
                await self.prune()
            except Exception:
                log.exception("pruning expired files failed")
        async with self.store.tx() as conn:
            active = await store_batches.active_batches(conn)
        busy = False
        for batch in active:
            if self._stopping:
                break
            try:
                busy |= await self._advance(batch)
            except Exception:  # a fault of one batch must not stop the others
                log.exception("batch %s: runner error", batch.id)
        return busy

    async def _advance(self, batch: BatchRecord) -> bool:
        if batch.status == "validating":
            task = self._validations.get(batch.id)
            if task is None or task.done():
                self._validations[batch.id] = asyncio.create_task(self._validate(batch))
            return False
        if batch.status == "cancelling":
            if batch.id in self._validations and not self._validations[batch.id].done():
                return False  # let validation notice the cancel and stop first
            return await self._finish(batch, "cancelled", "batch_cancelled")
        if batch.status == "finalizing":
            return await self._finish(batch, "completed", None)
        if batch.status == "in_progress":
            if now() >= batch.expires_at:
                return await self._finish(batch, "expired", "batch_expired")
            async with self.store.tx() as conn:
                torn = await store_models.weights_torn(conn, batch.model or "")
            ready = readiness(self.ctx, batch, weights_torn=torn, lease_ttl_seconds=self.settings.batch_lease_ttl_seconds)
            if ready.waiting_reason is not None:
                await self._set_waiting(batch, ready.waiting_reason, None)
                return False
            return await self._run_chunk(batch, ready)
        return False

    async def _set_waiting(self, batch: BatchRecord, reason: str | None, holder: str | None) -> None:
        if (batch.waiting_reason, batch.lease_holder) != (reason, holder):
            async with self.store.tx() as conn:
                await store_batches.set_fields(conn, batch.id, waiting_reason=reason, lease_holder=holder)
            self.on_change(batch.id)

    # -- validation -------------------------------------------------------------------------------------------

    async def _validate(self, batch: BatchRecord) -> None:
        try:
            await self._validate_inner(batch)
        except BatchFailure as failure:
            async with self.store.tx() as conn:
                await store_batches.transition(
                    conn, batch.id, ("validating",), "failed", now(), errors=[failure.as_batch_error()]
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: validation error", batch.id)
            async with self.store.tx() as conn:
                await store_batches.transition(
                    conn,
                    batch.id,
                    ("validating",),
                    "failed",
                    now(),
                    errors=[{"code": "server_error", "message": "Validation failed on the server.", "param": None, "line": None}],
                )
        self.on_change(batch.id)
        self.wake()

    async def _validate_inner(self, batch: BatchRecord) -> None:
        async with self.store.tx() as conn:
            if not await store_batches.claim_batch(
                conn, batch.id, worker=self.worker_id, now_ms=now_ms(), ttl_ms=self.claim_ttl_ms
            ):
                return  # another process validates it
            await store_rows.delete_rows(conn, batch.id)  # a validation cut short by a crash starts over
            record = await store_files.get_file(conn, batch.input_file_id)
        if record is None:
            raise BatchFailure("file_not_found", f"The input file {batch.input_file_id} no longer exists.", "input_file_id")
        if record.content_deleted_at is not None or (record.expires_at is not None and record.expires_at <= now()):
            raise BatchFailure("file_expired", f"The input file {batch.input_file_id} has expired.", "input_file_id")
        seen: set[str] = set()
        models: set[str] = set()
        errors: list[dict[str, object]] = []
        page: list[dict[str, object]] = []
        total = invalid = 0
        async for number, raw in physical_lines(store_files.iter_content(self.store.engine, batch.input_file_id)):
            if not raw.strip():
                continue
            total += 1
            custom_id, body, model, error = check_line(self.ctx, batch.endpoint, raw, seen)
            if error is not None:
                invalid += 1
                if len(errors) < MAX_LISTED_ERRORS:
                    errors.append(error.as_batch_error(number))
                page.append({"line": number, "custom_id": custom_id, "valid": False, "result": error_line(custom_id, number, error)})
            else:
                assert model is not None
                models.add(model)
                page.append({"line": number, "custom_id": custom_id, "valid": True, "body": json.dumps(body, ensure_ascii=False)})
            if len(page) >= INSERT_PAGE:
                await self._insert(batch.id, page)
                page = []
            if total % 2000 == 0:
                async with self.store.tx() as conn:  # heartbeat, and let requests through
                    await store_batches.claim_batch(
                        conn, batch.id, worker=self.worker_id, now_ms=now_ms(), ttl_ms=self.claim_ttl_ms
                    )
        await self._insert(batch.id, page)
        if total == 0:
            raise BatchFailure("empty_file", "The input file has no request lines.", "input_file_id")
        foreign = foreign_lease_holder(self.ctx, batch)
        async with self.store.tx() as conn:
            await store_batches.set_fields(conn, batch.id, total=total, failed=invalid)
            if invalid < total and len(models) == 1 and foreign is not None:
                raise BatchFailure("lease_unavailable", f"The model is leased by another holder ('{foreign}').", "model")
            if invalid == total or len(models) > 1:
                failure = (
                    BatchFailure("no_valid_lines", "No line of the input file is a valid request.")
                    if invalid == total
                    else BatchFailure(
                        "multiple_models",
                        "The valid lines name more than one model: " + ", ".join(sorted(models)) + ".",
                        "model",
                    )
                )
                listed = [*errors, failure.as_batch_error()] if invalid == total else [failure.as_batch_error(), *errors]
                current = await store_batches.get_batch(conn, batch.id)
                if current is not None and current.status == "validating":
                    await output.finish(
                        conn,
                        current,
                        allowed=("validating",),
                        to="failed",
                        unrun_code="batch_cancelled",
                        file_expiry_seconds=self.settings.file_default_expiry_seconds,
                        extra={"errors": listed[: MAX_LISTED_ERRORS + 1]},
                    )
                return
            await store_batches.transition(
                conn,
                batch.id,
                ("validating",),
                "in_progress",
                now(),
                model=next(iter(models)),
                errors=errors or None,
                waiting_reason="queued",
            )

    async def _insert(self, batch_id: str, page: list[dict[str, object]]) -> None:
        if page:
            async with self.store.tx() as conn:
                await store_rows.insert_rows(conn, batch_id, page)

    # -- running ----------------------------------------------------------------------------------------------

    async def _run_chunk(self, batch: BatchRecord, ready: Readiness) -> bool:
        token = secrets.token_hex(16)
        async with self.store.tx() as conn:
            claimed = await store_rows.claim(
                conn,
                batch_id=batch.id,
                limit=packing.claim_limit(self.settings, batch),  # a packed batch claims a packing window
                worker=self.worker_id,
                token=token,
                now_ms=now_ms(),
                ttl_ms=self.claim_ttl_ms,
                skip_locked=self.store.skip_locked,
            )
            if not claimed:
                if await store_rows.count_pending(conn, batch.id) == 0:
                    await store_batches.transition(conn, batch.id, ("in_progress",), "finalizing", now())
                    self.on_change(batch.id)
                    return True
                return False  # another worker holds the remaining rows
        service = SERVICES[batch.endpoint]
        try:
            async with self.ctx.gate.hold(Priority.BATCH) as slot, self._heartbeat(batch.id, token):
                if not self._model_resident(batch):
                    # the model was unloaded or swapped while this chunk waited for the slot: run nothing
                    await self._set_waiting(batch, "model_not_resident", None)
                    return True
                await self._set_waiting(batch, None, ready.holder)
                started = time.monotonic()
                # -- packing (pack: true on a packable endpoint): the window runs in length-aware packs ---------
                if packing.packs(batch):
                    limit = self.settings.batch_chunk_seconds
                    call = Call(strict=True, priority=Priority.BATCH, slot=slot, lease=ready.lease,
                                should_stop=lambda: self._stopping or time.monotonic() - started > limit)  # fmt: skip
                    await packing.run_window(ctx=self.ctx, store=self.store, service=service, batch_id=batch.id,
                                             token=token, rows=claimed, call=call, settings=self.settings,
                                             on_change=self.on_change)  # fmt: skip
                    claimed = []  # every row was recorded above or is released below
                # -- end of packing --------------------------------------------------------------------------------
                for i, row in enumerate(claimed):
                    if self._stopping or time.monotonic() - started > self.settings.batch_chunk_seconds:
                        break
                    if i > 0 and self.ctx.gate.queue_length(Priority.INTERACTIVE):
                        break  # someone is waiting: end the chunk at this row boundary (rest is released below)
                    call = Call(strict=True, priority=Priority.BATCH, slot=slot, lease=ready.lease)
                    try:
                        ok, line, usage = await self._execute(service, row, call)
                    except EngineUnavailableError:
                        break  # not the row's fault: it stays pending and runs when the model is back
                    async with self.store.tx() as conn:
                        recorded = await store_rows.record(
                            conn,
                            batch_id=batch.id,
                            line=row.line,
                            token=token,
                            ok=ok,
                            result=line,
                            input_tokens=usage[0],
                            output_tokens=usage[1],
                        )
                        cancelled = await store_batches.get_status(conn, batch.id) == "cancelling"
                    if not recorded:
                        log.warning("batch %s line %d: claim lost, result dropped", batch.id, row.line)
                        break
                    self.on_change(batch.id)
                    if cancelled:
                        break  # a cancel arrived: end the chunk at this row boundary (the rest is released below)
        finally:
            async with self.store.tx() as conn:
                await store_rows.release_claim(conn, batch_id=batch.id, token=token)
        return True

    def _model_resident(self, batch: BatchRecord) -> bool:
        engine = self.ctx.engine
        return engine is not None and not self.ctx.loading and engine.info.model_id == batch.model

    @contextlib.asynccontextmanager
    async def _heartbeat(self, batch_id: str, token: str) -> AsyncIterator[None]:
        """Extend the chunk's claim every third of its TTL while the chunk runs (even within a long row)."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.claim_ttl_ms / 3000)
                async with self.store.tx() as conn:
                    await store_rows.extend_claim(
                        conn, batch_id=batch_id, token=token, until_ms=now_ms() + self.claim_ttl_ms
                    )

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _execute(
        self, service: EndpointService, row: store_rows.ClaimedRow, call: Call
    ) -> tuple[bool, str, tuple[int, int]]:
        body = json.loads(row.body)
        try:
            result = await service.create(self.ctx, body, call)
            assert isinstance(result, ServiceResult)
            return True, output.success_line(row.custom_id, result), (result.prompt_tokens, result.completion_tokens)
        except EngineUnavailableError:
            raise
        except APIError as exc:
            return False, output.failure_line(row.custom_id, exc), (0, 0)
        except Exception:
            log.exception("row %s failed on the server", row.custom_id)
            return False, output.failure_line(row.custom_id, ServerError(SERVER_ERROR_MESSAGE)), (0, 0)

    # -- finishing --------------------------------------------------------------------------------------------

    async def _finish(self, batch: BatchRecord, to: str, unrun_code: str | None) -> bool:
        try:
            async with self.store.tx() as conn:
                await output.finish(
                    conn,
                    batch,
                    allowed=states.sources(to) if to != "completed" else ("finalizing",),
                    to=to,
                    unrun_code=unrun_code,
                    file_expiry_seconds=self.settings.file_default_expiry_seconds,
                )
        except output.StatusMoved:
            return True  # e.g. cancelled while finalizing: the next pass finishes it as cancelled
        release_own_lease(self.ctx, batch.id)
        self.on_change(batch.id)
        return True


