"""The Batches API's rules (DESIGN §3.2): endpoint, completion window, metadata, input file, cancel, listing.

Each rule is written here once; ``api/batches.py`` parses the HTTP request and returns what these functions build.
Functions check (raising the :class:`~miserver.errors.APIError` subclasses of ``errors.py``), then read or write
through one unit of work of the store (:meth:`~miserver.store.Store.tx`), then build the OpenAI Batch object.
Status changes are the guarded statements of ``store/batches.py``; running a batch is the runner's job.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...clock import now
from ...errors import ConflictError, InvalidRequestError, NotFoundError
from ...ids import ordered_id
from ...protocol.batches import (
    BATCH_ENDPOINTS,
    BATCH_STATUSES,
    TERMINAL,
    Batch,
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchExtension,
    BatchUsage,
    RequestCounts,
)
from ...protocol.parsing import parse_request
from ...store import Store
from ...store import batch_states as states
from ...store import batches as store_batches
from ...store import files as store_files
from ...store.batches import BatchRecord
from ...store.files import FileRecord
from ..accounts import keys as accounts
from ..accounts.prices import PriceTable
from ..accounts.quotas import check_batch_create
from ..inference.checks import check_metadata, decode_json
from .eta import check_on_time
from .files import content_expired
from .idempotency import Keyed, check_key, create_once

#: ``completion_window``: whole hours, written ``<n>h`` without a leading zero.
WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")
#: ``GET /v1/batches``: ``limit`` is 1..this.
LIST_LIMIT_MAX = 100
#: The statuses of a batch that has not finished.
LIVE_STATUSES: tuple[str, ...] = tuple(s for s in BATCH_STATUSES if s not in TERMINAL)


@dataclass(frozen=True)
class BatchCreate:
    """A ``POST /v1/batches`` as received: the body's bytes (decoded only after an idempotent replay is ruled out;
    parsed strictly), the caller's lease (``X-miLLM-Lease``) and the ``Idempotency-Key``."""

    raw: bytes
    caller_lease: str | None = None
    idempotency_key: str | None = None

    def fingerprint(self) -> str:
        """Hex SHA-256 of the body and the lease header: what makes a retry the same request."""
        return hashlib.sha256(self.raw + b"\0" + (self.caller_lease or "").encode()).hexdigest()


# -- checks (pure) ---------------------------------------------------------------------------------------------


def check_endpoint(endpoint: str) -> None:
    """400 ``invalid_value`` (param ``endpoint``) unless ``endpoint`` is one a batch accepts; the message lists them."""
    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequestError(
            f"Invalid 'endpoint': {endpoint!r}. Supported: {', '.join(BATCH_ENDPOINTS)}.", param="endpoint"
        )


def window_hours(window: str, max_hours: int) -> int:
    """``"24h"`` -> 24. 400 ``invalid_value`` (param ``completion_window``) when malformed (``"24"``, ``"1d"``,
    ``"01h"``) or outside ``1h``..``<max_hours>h`` (``BATCH_MAX_COMPLETION_WINDOW``)."""
    m = WINDOW.match(window)
    hours = int(m.group(1)) if m else 0
    if not m or not 1 <= hours <= max_hours:
        raise InvalidRequestError(
            f"Invalid 'completion_window': {window!r}. Use whole hours from '1h' to '{max_hours}h' (e.g. '24h').",
            param="completion_window",
        )
    return hours


def check_input_file(record: FileRecord | None, file_id: str, at: int) -> None:
    """The input file must exist, have purpose ``batch`` and still have its content at ``at`` (Unix seconds);
    else 400 ``invalid_value`` (param ``input_file_id``)."""
    if record is None:
        raise InvalidRequestError(f"No file with id {file_id!r}.", param="input_file_id")
    if record.purpose != "batch":
        raise InvalidRequestError(
            f"The file {file_id} has purpose {record.purpose!r}; a batch needs purpose 'batch'.",
            param="input_file_id",
        )
    if content_expired(record, at):
        raise InvalidRequestError(f"The file {file_id} has expired.", param="input_file_id")


def check(body: Any, *, max_window_hours: int) -> tuple[BatchCreateRequest, int]:
    """Parse and check a create body (decoded JSON): the request model, always strict (an unknown field is 400
    ``unknown_parameter`` naming it, as OpenAI refuses it), then :func:`check_request`. Returns the request and its
    window in hours; raises 400 naming the param. ``output_expires_after`` bounds are the request model's
    (3600..2592000 s)."""
    req = parse_request(BatchCreateRequest, body, strict=True)
    return req, check_request(req, max_window_hours=max_window_hours)


def check_request(req: BatchCreateRequest, *, max_window_hours: int) -> int:
    """Check a parsed create request: the endpoint, the window and the metadata, in that order. Returns the window
    in hours; raises 400 naming the param."""
    check_endpoint(req.endpoint)
    hours = window_hours(req.completion_window, max_window_hours)
    check_metadata(req.metadata)
    return hours


def not_found(batch_id: str) -> NotFoundError:
    """404 ``not_found`` for a batch id with no record."""
    return NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="not_found")


# -- build -----------------------------------------------------------------------------------------------------


def batch_object(b: BatchRecord) -> dict[str, Any]:
    """The OpenAI Batch object plus miServer's ``millm`` block, as JSON-ready data.

    ``millm.waiting_reason`` shows only while ``in_progress``; ``millm.description`` is ``metadata.description``;
    ``millm.paused`` and ``millm.estimated_completion_at`` are about a batch that may still run, so a batch that
    ended (cancelled, expired or failed while paused, say) is never ``paused``.
    """
    errors = BatchErrors(data=[BatchError(**e) for e in b.errors]) if b.errors else None
    return Batch(
        id=b.id,
        endpoint=b.endpoint,
        model=b.model,
        errors=errors,
        input_file_id=b.input_file_id,
        completion_window=b.completion_window,
        status=b.status,  # type: ignore[arg-type]
        output_file_id=b.output_file_id,
        error_file_id=b.error_file_id,
        created_at=b.created_at,
        in_progress_at=b.in_progress_at,
        expires_at=b.expires_at,
        finalizing_at=b.finalizing_at,
        completed_at=b.completed_at,
        failed_at=b.failed_at,
        expired_at=b.expired_at,
        cancelling_at=b.cancelling_at,
        cancelled_at=b.cancelled_at,
        request_counts=RequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        metadata=b.metadata,
        usage=BatchUsage(
            input_tokens=b.input_tokens, output_tokens=b.output_tokens, total_tokens=b.input_tokens + b.output_tokens
        ),
        millm=BatchExtension(
            pack=b.pack,
            waiting_reason=_waiting_reason(b),  # type: ignore[arg-type]
            lease_holder=b.lease_holder,
            description=(b.metadata or {}).get("description"),
            weights_revision=b.weights_revision,
            priority=b.priority,
            paused=b.paused_at is not None and not b.terminal,
            estimated_completion_at=None if b.terminal else b.estimated_completion_at,
        ),
    ).model_dump()


def _waiting_reason(b: BatchRecord) -> str | None:
    """Why an ``in_progress`` batch is not running now: ``paused`` as soon as it is paused, else what the runner
    stored; None for any other status."""
    if b.status != "in_progress":
        return None
    return "paused" if b.paused_at is not None else b.waiting_reason


# -- operations ------------------------------------------------------------------------------------------------


async def create_batch(
    store: Store,
    form: BatchCreate,
    *,
    max_window_hours: int,
    pack_default: bool,
    prices: PriceTable | None = None,
) -> dict[str, Any]:
    """Create a batch in ``validating`` from a ``POST /v1/batches`` and return its Batch object (replayed for a
    retry under the same Idempotency-Key; the caller then wakes the runner).

    Raises 400 for the Idempotency-Key and the JSON (:func:`check`), 409 for an Idempotency-Key conflict, and what
    :func:`insert_checked` raises. Nothing is created on error.
    """
    request = Keyed(accounts.keyed_route("batches"), check_key(form.idempotency_key), form.fingerprint())

    async def create(conn: AsyncConnection) -> dict[str, Any]:
        req, hours = check(decode_json(form.raw), max_window_hours=max_window_hours)
        return await insert_checked(
            conn, req, hours, caller_lease=form.caller_lease, pack_default=pack_default, prices=prices
        )

    return await create_once(store, request, create)


async def create_batch_request(
    store: Store,
    req: BatchCreateRequest,
    *,
    max_window_hours: int,
    pack_default: bool,
    prices: PriceTable | None = None,
) -> dict[str, Any]:
    """Create a batch from a request built in-process (the console's form) and return its Batch object: the checks
    of :func:`check_request`, then :func:`insert_checked`, in one transaction. Raises what they raise; nothing is
    created on error."""
    hours = check_request(req, max_window_hours=max_window_hours)
    async with store.tx() as conn:
        return await insert_checked(conn, req, hours, caller_lease=None, pack_default=pack_default, prices=prices)


async def insert_checked(
    conn: AsyncConnection,
    req: BatchCreateRequest,
    hours: int,
    *,
    caller_lease: str | None,
    pack_default: bool,
    prices: PriceTable | None,
) -> dict[str, Any]:
    """Insert a checked create request (its window ``hours``) as a batch in ``validating``; returns its Batch object.

    ``expires_at`` is ``created_at`` + the window; ``pack`` defaults to ``pack_default`` (``BATCH_PACK_DEFAULT``).
    The batch belongs to the calling key and keeps the batch prices of ``prices`` as they are now.
    Raises 400 for the input file (:func:`check_input_file`; another key's file is "no file") and for a batch that
    cannot finish in its window; 402 ``insufficient_quota`` for a key whose balance is used up and 429 for a key at
    a queue quota (:func:`~miserver.services.accounts.quotas.check_batch_create`).
    """
    principal = accounts.current()
    await check_batch_create(conn, principal)
    created = now()
    record = await store_files.get_file(conn, req.input_file_id, lock=True)
    visible = record if record is not None and accounts.visible(record.owner_key_id) else None
    check_input_file(visible, req.input_file_id, created)
    if not req.millm_allow_late:
        await check_on_time(
            conn,
            input_file_id=req.input_file_id,
            endpoint=req.endpoint,
            priority=req.priority or 0,
            window_seconds=hours * 3600,
        )
    batch = await store_batches.insert_batch(
        conn,
        batch_id=ordered_id("batch_"),
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        created_at=created,
        expires_at=created + hours * 3600,
        metadata=req.metadata,
        pack=pack_default if req.pack is None else req.pack,
        output_expires_seconds=req.output_expires_after.seconds if req.output_expires_after else None,
        caller_lease=caller_lease,
        weights_revision=req.weights_revision,
        priority=req.priority or 0,
        allow_late=bool(req.millm_allow_late),
        owner_key_id=principal.owner,
        prices=prices.batch_snapshot() if prices is not None and prices.enabled else None,
    )
    return batch_object(batch)


def check_list(limit: int) -> None:
    """``GET /v1/batches`` paging: ``limit`` in 1..100, else 400 (param ``limit``)."""
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {LIST_LIMIT_MAX}.", param="limit")


async def list_batches(store: Store, *, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
    """One page of Batch objects, newest first, after the batch ``after``, and whether more follow.

    Raises 400 for ``limit`` outside 1..100 and for an ``after`` that names no batch.
    """
    check_list(limit)
    async with store.tx() as conn:
        cursor = await store_batches.get_batch(conn, after) if after is not None else None
        if after is not None and (cursor is None or not accounts.visible(cursor.owner_key_id)):
            raise InvalidRequestError(f"Invalid 'after': no batch with id {after!r}.", param="after")
        page, has_more = await store_batches.list_batches(conn, limit=limit, after=after, owner=accounts.scope())
    return [batch_object(b) for b in page], has_more


async def retrieve_batch(store: Store, batch_id: str) -> dict[str, Any]:
    """The Batch object of ``batch_id``; 404 ``not_found`` (also for another key's batch)."""
    async with store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id)
    if batch is None or not accounts.visible(batch.owner_key_id):
        raise not_found(batch_id)
    return batch_object(batch)


async def cancel_batch(store: Store, batch_id: str) -> dict[str, Any]:
    """Ask a batch to stop: ``validating``/``in_progress``/``finalizing`` -> ``cancelling`` (the runner ends it
    ``cancelled``); a ``cancelling`` or ``cancelled`` batch is returned unchanged. Returns the Batch object (the
    caller then wakes the runner).

    Raises 404 ``not_found``, and 409 ``batch_not_cancellable`` for a completed, failed or expired batch.
    """
    async with store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id)
        if batch is None or not accounts.visible(batch.owner_key_id):
            raise not_found(batch_id)
        await store_batches.try_transition(conn, batch_id, states.CANCELLABLE, "cancelling", now())
        batch = await store_batches.get_batch(conn, batch_id)
    if batch is None:
        raise not_found(batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise ConflictError(
            f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id", code="batch_not_cancellable"
        )
    return batch_object(batch)


async def hand_lease(store: Store, batch_id: str, lease: str) -> dict[str, Any]:
    """Run a batch that has not finished under the caller's lease ``lease`` (checked live by the caller) from now
    on; returns the Batch object (the caller then wakes the runner).

    Raises 404 ``not_found``, and 409 ``batch_finished`` when the batch has ended (before the read, or between the
    read and the guarded write).
    """
    async with store.tx() as conn:
        batch = await store_batches.get_batch(conn, batch_id)
        if batch is None or not accounts.visible(batch.owner_key_id):
            raise not_found(batch_id)
        try:
            await store_batches.set_fields(conn, batch_id, LIVE_STATUSES, caller_lease=lease)
        except store_batches.StaleStatus:
            status = await store_batches.get_status(conn, batch_id) or batch.status
            raise ConflictError(f"The batch is {status}.", param="batch_id", code="batch_finished") from None
        batch = await store_batches.get_batch(conn, batch_id)
    assert batch is not None
    return batch_object(batch)
