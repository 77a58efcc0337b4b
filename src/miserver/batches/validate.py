"""Streamed validation of a batch input file (DESIGN §4, "Validation"): the line checks and their driver.

The file is read chunk by chunk; each physical line is numbered from 1 (blank lines keep their number but are not
requests). A line becomes a valid row or an error row whose error is exactly what the synchronous route would have
answered for the same body (the endpoint service's own ``check`` in strict mode). :class:`Validator` drives a whole
batch through it under the batch's validation claim.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy.ext.asyncio import AsyncConnection

from ..clock import now, now_ms
from ..errors import (
    APIError,
    InvalidRequestError,
    MissingParameterError,
    UnknownParameterError,
)
from ..protocol.batches import ANTHROPIC_MESSAGES, BatchInputLine
from ..protocol.text import check_text, find_unpaired_surrogate
from ..services.batch_api.estimates import estimate_input_tokens
from ..services.batch_api.files import content_expired
from ..services.inference.context import ServiceContext
from ..services.inference.registry import SERVICES
from ..settings import Settings
from ..store import Store
from ..store import batches as store_batches
from ..store import files as store_files
from ..store import keys as store_keys
from ..store import rows as store_rows
from ..store.batches import BatchRecord
from . import output
from .readiness import foreign_lease_holder

LINE_KEYS = ("custom_id", "method", "url", "body")
#: Longest custom_id accepted (the Anthropic Message Batches limit; OpenAI documents none).
MAX_CUSTOM_ID_CHARS = 64
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
#: ``batch.errors.data`` lists at most this many line errors; the error file has every one.
MAX_LISTED_ERRORS = 1000


class BatchFailure(Exception):
    """The whole batch fails validation (empty file, no valid line, several models...)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def as_batch_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": None}


@dataclass
class ValidationSummary:
    """Counts of one pass; ``models`` are the distinct models named by valid lines."""

    total: int = 0
    valid: int = 0
    invalid: int = 0
    models: set[str] = field(default_factory=set)
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: input tokens of the valid lines, counted only when the owner key has an enqueued-token quota
    tokens: int = 0
    #: numbers of the lines that name a model nobody serves (``model_not_found``); in gateway mode they fail the batch
    unserved: list[int] = field(default_factory=list)


async def physical_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """Yield ``(line_number, raw_line)`` with a leading UTF-8 BOM stripped and ``\\r\\n`` accepted.

    Raises :class:`BatchFailure` (``invalid_encoding``) for a UTF-16 or binary file (a UTF-16 byte-order mark, or
    NUL bytes in the first line), which a line-by-line reading would otherwise report as garbage on every line.
    """
    buf = b""
    number = 0
    first = True
    async for chunk in chunks:
        if first:
            if chunk.startswith(UTF16_BOMS) or b"\x00" in chunk.split(b"\n", 1)[0]:
                raise BatchFailure(
                    "invalid_encoding",
                    "The input file looks like UTF-16 or binary (NUL bytes in its first line); batch files must be "
                    "UTF-8 JSON Lines (save it as UTF-8).",
                    "input_file_id",
                )
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
            first = False
        buf += chunk
        *complete, buf = buf.split(b"\n")
        for raw in complete:
            number += 1
            yield number, raw[:-1] if raw.endswith(b"\r") else raw
    if buf:
        number += 1
        yield number, buf[:-1] if buf.endswith(b"\r") else buf


class CheckedLine(NamedTuple):
    """One checked line: ``error`` is None when the line is a valid request (then ``body`` and ``model`` are set);
    ``custom_id`` is the line's id when it could be read (None when absent, not a string, or not encodable)."""

    custom_id: str | None
    body: dict[str, Any] | None
    model: str | None
    error: APIError | None


class _Refused(Exception):
    def __init__(self, custom_id: str | None, error: APIError) -> None:
        self.custom_id = custom_id
        self.error = error


def check_line(ctx: ServiceContext, endpoint: str, raw: bytes, seen: set[str]) -> CheckedLine:
    """Validate one non-blank line against ``endpoint`` (DESIGN §4, "Validation"): UTF-8, a JSON object, the line
    fields parsed strictly as :class:`~miserver.protocol.batches.BatchInputLine`, ``custom_id`` non-empty, at most
    64 characters and unique (``seen`` collects the ids), ``method`` POST, ``url`` the endpoint, no streaming, and the
    body checked by the endpoint service's own ``check`` in strict mode (the synchronous route's code and message)."""
    try:
        line, body, model = _check(ctx, endpoint, raw, seen)
    except _Refused as refused:
        return CheckedLine(refused.custom_id, None, None, refused.error)
    return CheckedLine(line.custom_id, body, model, None)


def _refuse(custom_id: str | None, message: str, *, param: str | None = None, code: str | None = None) -> _Refused:
    return _Refused(custom_id, InvalidRequestError(message, param=param, code=code))


def _check(
    ctx: ServiceContext, endpoint: str, raw: bytes, seen: set[str]
) -> tuple[BatchInputLine, dict[str, Any], str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(None, f"Line is not valid UTF-8 (byte {exc.start}).", code="invalid_encoding") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(None, f"Line is not valid JSON: {exc.msg}.", code="invalid_json_line") from None
    except RecursionError:
        raise _refuse(None, "Line is nested too deeply to be read.", code="invalid_json_line") from None
    if not isinstance(obj, dict):
        raise _refuse(None, "Line must be a JSON object.", code="invalid_json_line")
    cid = obj.get("custom_id")
    try:  # the line's own fields; the body's strings are the service's to check (named as the route names them)
        check_text({k: v for k, v in obj.items() if k != "body"})
    except InvalidRequestError as exc:
        clean = cid if isinstance(cid, str) and find_unpaired_surrogate(cid) is None else None
        raise _Refused(clean, exc) from None
    custom_id = cid if isinstance(cid, str) else None
    for key in LINE_KEYS:  # named in the line's own order of importance, before the schema's
        if key not in obj:
            raise _Refused(custom_id, MissingParameterError(f"Missing required parameter: '{key}'.", param=key))
    if not isinstance(cid, str):
        raise _refuse(None, "'custom_id' must be a string.", param="custom_id", code="invalid_type")
    if not cid:
        raise _refuse(None, "'custom_id' must be a non-empty string.", param="custom_id")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        message = f"'custom_id' is {len(cid)} characters; at most {MAX_CUSTOM_ID_CHARS} are allowed."
        raise _refuse(None, message, param="custom_id")
    if cid in seen:
        message = f"The custom_id '{cid}' appears more than once in the file."
        raise _refuse(cid, message, param="custom_id", code="duplicate_custom_id")
    seen.add(cid)
    extra = [k for k in obj if k not in LINE_KEYS]
    if extra:
        raise _Refused(cid, UnknownParameterError(f"Unrecognized line field: '{extra[0]}'.", param=extra[0]))
    if obj["method"] != "POST":
        raise _refuse(cid, "'method' must be \"POST\".", param="method")
    if obj["url"] != endpoint:
        hint = f" Write it as {endpoint!r}." if isinstance(obj["url"], str) and "/v1" + obj["url"] == endpoint else ""
        message = f"The line's url {obj['url']!r} does not match the batch's endpoint {endpoint!r}.{hint}"
        raise _refuse(cid, message, param="url", code="invalid_url")
    if not isinstance(obj["body"], dict):
        raise _refuse(cid, "'body' must be a JSON object.", param="body", code="invalid_type")
    line = BatchInputLine.model_validate(obj)  # cannot fail after the checks above (unknown fields were refused)
    body = line.body
    if body.get("stream") is True:
        message = "Streaming is not supported in a batch: remove 'stream' or set it to false."
        raise _refuse(cid, message, param=body_param("stream", endpoint), code="streaming_unsupported")
    try:
        _request, engine = SERVICES[endpoint].check(ctx, body, strict=True)
    except APIError as exc:
        if exc.param is not None:
            exc.param = body_param(exc.param, endpoint)
        raise _Refused(cid, exc) from None
    return line, body, engine.info.model_id


def body_param(param: str, endpoint: str) -> str:
    """How a validation error names a field of a line's body: OpenAI's Batch API form ``body.<param>``
    (``body.model``, ``body.messages[0].content``), so that ``errors.data[].param`` and the error line say where in
    the line the field is; the code and message stay the synchronous route's. Anthropic's Message Batches keep the
    synchronous form (their errors name no line field)."""
    return param if endpoint == ANTHROPIC_MESSAGES else f"body.{param}"


@dataclass(frozen=True)
class TokenQuota:
    """An owner key's enqueued-token quota at validation: its ``limit`` and the ``enqueued_tokens`` its other
    unfinished batches reserve."""

    limit: int
    enqueued_tokens: int


# -- the validation driver ----------------------------------------------------------------------------------------

#: Rows inserted per transaction while validating.
INSERT_PAGE = 500
#: Lines between two heartbeats of the validation claim.
HEARTBEAT_LINES = 2000


@dataclass
class Validator:
    """Validates one ``validating`` batch for ``worker``: claims it, streams its input file through
    :func:`check_line`, inserts the rows, and moves it to ``in_progress`` (or ``failed``), all guarded by the
    validation claim (``store.batches.claim_validation``/``hold_validation``): a stale read can never restart a
    finished validation or delete recorded rows, and every write lands only while the claim holds.

    A cancel does not stop it: it reads the file to the end so that every line is accounted for, then leaves the
    batch ``cancelling`` for the runner to finish. Raises :class:`~miserver.store.batches.StaleStatus` when the batch
    finished meanwhile or another process took the claim over; :class:`BatchFailure` when the whole batch fails
    validation.
    """

    store: Store
    ctx: ServiceContext
    settings: Settings
    worker: str

    async def _hold(self, conn: AsyncConnection, batch_id: str) -> str:
        return await store_batches.hold_validation(
            conn, batch_id, worker=self.worker, now_ms=now_ms(), ttl_ms=self._ttl_ms
        )

    @property
    def _ttl_ms(self) -> int:
        return int(self.settings.batch_claim_ttl_seconds * 1000)

    async def _insert(self, batch_id: str, page: list[dict[str, object]]) -> None:
        if page:
            async with self.store.tx() as conn:
                await self._hold(conn, batch_id)
                await store_rows.insert_rows(conn, batch_id, page)

    async def run(self, batch: BatchRecord) -> bool:
        """Validate ``batch``; False when another live process holds its validation (nothing was done)."""
        async with self.store.tx() as conn:
            if not await store_batches.claim_validation(
                conn, batch.id, worker=self.worker, now_ms=now_ms(), ttl_ms=self._ttl_ms
            ):
                return False
            await store_rows.delete_rows(conn, batch.id, worker=self.worker)  # a validation cut short starts over
            record = await store_files.get_file(conn, batch.input_file_id)
        if record is None:  # a guard: the API never deletes the input of a batch that has not finished
            raise BatchFailure(
                "file_not_found", f"The input file {batch.input_file_id} no longer exists.", "input_file_id"
            )
        if content_expired(record, now()):
            raise BatchFailure("file_expired", f"The input file {batch.input_file_id} has expired.", "input_file_id")
        summary = ValidationSummary()
        quota = await self._token_quota(batch)
        page: list[dict[str, object]] = []
        seen: set[str] = set()
        async for number, raw in physical_lines(self.store.file_content(batch.input_file_id)):
            if not raw.strip():
                continue
            summary.total += 1
            custom_id, body, model, error = check_line(self.ctx, batch.endpoint, raw, seen)
            if error is not None:
                summary.invalid += 1
                if error.code == "model_not_found":
                    summary.unserved.append(number)
                if len(summary.errors) < MAX_LISTED_ERRORS:
                    summary.errors.append(error.as_batch_error(number))
                line = output.invalid_line(custom_id, number, error, batch.endpoint)
                page.append({"line": number, "custom_id": custom_id, "valid": False, "result": line})
            else:
                assert model is not None
                summary.valid += 1
                summary.models.add(model)
                if quota is not None and self.ctx.engine is not None and body is not None:
                    summary.tokens += estimate_input_tokens(self.ctx.engine.tokenize, body)
                text = json.dumps(body, ensure_ascii=False)
                page.append({"line": number, "custom_id": custom_id, "valid": True, "body": text, "model": model})
            if len(page) >= INSERT_PAGE:
                await self._insert(batch.id, page)
                page = []
            if summary.total % HEARTBEAT_LINES == 0:
                async with self.store.tx() as conn:  # heartbeat; a finished batch or a lost claim stops it here
                    await self._hold(conn, batch.id)
        await self._insert(batch.id, page)
        if summary.total == 0:
            raise BatchFailure("empty_file", "The input file has no request lines.", "input_file_id")
        if quota is not None and summary.valid and quota.enqueued_tokens + summary.tokens > quota.limit:
            raise BatchFailure(
                "token_limit_exceeded",
                f"Enqueued token limit reached: this batch has {summary.tokens} input tokens and the API key already "
                f"has {quota.enqueued_tokens} in batches not yet finished; its limit is {quota.limit}.",
                None,
            )
        await self._close(batch, summary)
        return True

    async def _token_quota(self, batch: BatchRecord) -> TokenQuota | None:
        """The owner key's enqueued-token limit and what its other unfinished batches hold (None: no quota)."""
        if batch.owner_key_id is None:
            return None
        async with self.store.read() as conn:
            key = await store_keys.get_key(conn, batch.owner_key_id)
            if key is None or key.max_enqueued_tokens is None:
                return None
            use = await store_keys.queue_use(conn, batch.owner_key_id)
        return TokenQuota(limit=key.max_enqueued_tokens, enqueued_tokens=use.enqueued_tokens)

    async def _close(self, batch: BatchRecord, summary: ValidationSummary) -> None:
        foreign = foreign_lease_holder(self.ctx, batch)
        async with self.store.tx() as conn:
            status = await self._hold(conn, batch.id)
            await store_batches.set_fields(
                conn,
                batch.id,
                (status,),
                total=summary.total,
                failed=summary.invalid,
                claimed_by=None,
                claimed_until=None,
            )
            if status == "cancelling":  # cancelled while validating: every line is in, the runner finishes it
                await store_batches.set_fields(conn, batch.id, (status,), errors=summary.errors or None)
                return
            # Gateway mode: models served by an upstream pool may be several; the one-model, lease and residency
            # rules are the resident model's. A line naming a model nobody serves fails the whole batch there,
            # listed as its own line error; with no upstream it fails alone (DESIGN §4).
            resident = sorted(m for m in summary.models if self.ctx.upstream_pool(m) is None)
            unserved = self.ctx.gateway is not None and bool(summary.unserved)
            if summary.valid and len(resident) == 1 and foreign is not None and not unserved:
                raise BatchFailure(
                    "lease_unavailable",
                    f"The model is leased by another holder ('{foreign}').",
                    body_param("model", batch.endpoint),
                )
            if not summary.valid or len(resident) > 1 or unserved:
                # One entry per invalid line (OpenAI's shape); a summary entry only where no line error explains
                # the failure (several models).
                listed = summary.errors
                if summary.valid and len(resident) > 1:
                    models = ", ".join(sorted(summary.models))
                    failure = BatchFailure(
                        "multiple_models",
                        f"The valid lines name more than one model: {models}.",
                        body_param("model", batch.endpoint),
                    )
                    listed = [failure.as_batch_error(), *summary.errors]
                current = await store_batches.get_batch(conn, batch.id)
                assert current is not None  # the claim held above
                await output.finish(
                    conn,
                    current,
                    allowed=("validating",),
                    to="failed",
                    unrun_code="batch_failed",  # the valid lines never ran: the batch failed, nobody cancelled it
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
                model=resident[0] if resident else min(summary.models),
                errors=summary.errors or None,
                waiting_reason="queued",
                enqueued_tokens=summary.tokens,
            )
