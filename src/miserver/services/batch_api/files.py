"""The Files API's rules (DESIGN §3.1, §6): purpose, ``expires_after``, expiry of content, listing, deletion.

Each rule is written here once; ``api/files.py`` parses the HTTP request and returns what these functions build,
and the batch layer asks :func:`content_expired` before it reads an input file. Functions check (raising the
:class:`~miserver.errors.APIError` subclasses of ``errors.py``), then read or write through one unit of work of
the store (:meth:`~miserver.store.Store.tx`), then build the OpenAI JSON object.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...clock import now
from ...errors import ConflictError, FileExpiredError, InvalidRequestError, MissingParameterError, NotFoundError
from ...ids import ordered_id
from ...protocol.files import EXPIRES_AFTER_MAX_SECONDS, EXPIRES_AFTER_MIN_SECONDS, FileDeleted, FileObject
from ...store import Store
from ...store import files as store_files
from ...store.files import FileRecord
from ..accounts import keys as accounts
from .idempotency import Keyed, check_key, create_once

#: The one purpose an upload may name (``batch_output`` files are written by the server).
UPLOAD_PURPOSE = "batch"
#: ``GET /v1/files``: ``limit`` is 1..this, and this is the default.
LIST_LIMIT_MAX = 10000
#: Bytes read from the spooled upload per piece handed to the store.
READ_BYTES = 1 << 20


@dataclass(frozen=True)
class FileUpload:
    """A parsed ``POST /v1/files`` form.

    ``fields``: the small text parts (``purpose``, ``expires_after[anchor]``, ``expires_after[seconds]``...);
    ``filename``: the ``file`` part's name; ``path``: where its bytes were spooled (None when the form had no
    ``file`` part); ``content_sha256``: hex SHA-256 of those bytes; ``idempotency_key``: the header, if sent.
    """

    fields: Mapping[str, str]
    filename: str | None
    path: Path | None
    content_sha256: str
    idempotency_key: str | None = None

    def fingerprint(self) -> str:
        """Hex SHA-256 of the content, the filename and every field: what makes a retry the same request."""
        parts = [self.content_sha256, self.filename, sorted(self.fields.items())]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


# -- checks (pure) ---------------------------------------------------------------------------------------------


def check_purpose(fields: Mapping[str, str]) -> str:
    """The upload's ``purpose``. 400 ``missing_required_parameter`` when absent, 400 ``invalid_value`` unless it is
    ``batch`` (param ``purpose``)."""
    purpose = fields.get("purpose")
    if purpose is None:
        raise MissingParameterError("Missing required parameter: 'purpose'.", param="purpose")
    if purpose != UPLOAD_PURPOSE:
        raise InvalidRequestError(f"Invalid 'purpose': {purpose!r}. This server accepts 'batch'.", param="purpose")
    return purpose


def _int_field(fields: Mapping[str, str], name: str) -> int | None:
    if name not in fields:
        return None
    try:
        return int(fields[name])
    except ValueError:
        raise InvalidRequestError(f"Invalid '{name}': expected an integer.", param=name) from None


def expires_at(fields: Mapping[str, str], created: int, default_seconds: int) -> int:
    """The file's ``expires_at`` (Unix seconds) from ``expires_after[anchor]`` / ``expires_after[seconds]``.

    Neither field: ``created + default_seconds`` (``FILE_DEFAULT_EXPIRY_SECONDS``). Otherwise the anchor must be
    ``created_at`` and the seconds an integer in 3600..2592000; each breach is a 400 naming the field.
    """
    anchor = fields.get("expires_after[anchor]")
    seconds = _int_field(fields, "expires_after[seconds]")
    if anchor is None and seconds is None:
        return created + default_seconds
    if anchor != "created_at":
        raise InvalidRequestError(
            "Invalid 'expires_after[anchor]': must be 'created_at'.", param="expires_after[anchor]"
        )
    if seconds is None:
        raise MissingParameterError(
            "Missing required parameter: 'expires_after[seconds]'.", param="expires_after[seconds]"
        )
    if not EXPIRES_AFTER_MIN_SECONDS <= seconds <= EXPIRES_AFTER_MAX_SECONDS:
        raise InvalidRequestError(
            f"Invalid 'expires_after[seconds]': must be between {EXPIRES_AFTER_MIN_SECONDS} and "
            f"{EXPIRES_AFTER_MAX_SECONDS}.",
            param="expires_after[seconds]",
        )
    return created + seconds


def content_expired(record: FileRecord, at: int) -> bool:
    """Whether the file's content is gone at Unix second ``at``: pruned already, or past its ``expires_at``.

    The one expiry rule of files: the content route answers 404 ``file_expired``, a batch create refuses the file
    (400, param ``input_file_id``), and batch validation fails the batch with ``file_expired``.
    """
    return record.content_deleted_at is not None or (record.expires_at is not None and record.expires_at <= at)


def check_list(limit: int, order: str) -> None:
    """``GET /v1/files`` paging: ``limit`` in 1..10000 and ``order`` ``asc``/``desc``, else 400 naming the param."""
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {LIST_LIMIT_MAX}.", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("Invalid 'order': must be 'asc' or 'desc'.", param="order")


def not_found(file_id: str) -> NotFoundError:
    """404 ``not_found`` for a file id with no record."""
    return NotFoundError(f"No such File object: {file_id}", param="file_id", code="not_found")


# -- build -----------------------------------------------------------------------------------------------------


def file_object(record: FileRecord) -> dict[str, Any]:
    """The OpenAI FileObject of ``record`` as JSON-ready data."""
    return FileObject(
        id=record.id,
        bytes=record.bytes,
        created_at=record.created_at,
        filename=record.filename,
        purpose=record.purpose,  # type: ignore[arg-type]
        status=record.status,  # type: ignore[arg-type]
        expires_at=record.expires_at,
        status_details=record.status_details,
    ).model_dump()


# -- operations ------------------------------------------------------------------------------------------------


def _read_pieces(path: Path) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while piece := fh.read(READ_BYTES):
            yield piece


async def create_file(store: Store, upload: FileUpload, *, default_expiry_seconds: int) -> dict[str, Any]:
    """Store an uploaded file and return its FileObject (replayed for a retry under the same Idempotency-Key).

    Raises 400 for the Idempotency-Key, ``purpose``, a missing ``file`` part or ``expires_after`` (in that order,
    after the replay), 409 for an Idempotency-Key conflict. The spooled file at ``upload.path`` is read, not removed.
    """
    # an Idempotency-Key is the caller's own: another key's same key never replays (or conflicts with) this one
    request = Keyed(accounts.keyed_route("files"), check_key(upload.idempotency_key), upload.fingerprint())

    async def create(conn: AsyncConnection) -> dict[str, Any]:
        check_purpose(upload.fields)
        if upload.path is None:
            raise MissingParameterError("Missing required parameter: 'file'.", param="file")
        created = now()
        record = await store_files.insert_file(
            conn,
            file_id=ordered_id("file-"),
            purpose=UPLOAD_PURPOSE,
            filename=upload.filename or "upload.jsonl",
            created_at=created,
            expires_at=expires_at(upload.fields, created, default_expiry_seconds),
            chunks=_read_pieces(upload.path),
            owner_key_id=accounts.current().owner,
        )
        return file_object(record)

    return await create_once(store, request, create)


async def list_files(
    store: Store, *, purpose: str | None, limit: int, order: str, after: str | None
) -> tuple[list[dict[str, Any]], bool]:
    """One page of FileObjects (by creation order, ``desc`` newest first) and whether more follow.

    Raises 400 for ``limit``/``order`` out of range and for an ``after`` that names no file.
    """
    check_list(limit, order)
    owner = accounts.scope()
    async with store.tx() as conn:
        cursor = await store_files.get_file(conn, after) if after is not None else None
        if after is not None and (cursor is None or not accounts.visible(cursor.owner_key_id)):
            raise InvalidRequestError(f"Invalid 'after': no file with id {after!r}.", param="after")
        page, has_more = await store_files.list_files(
            conn, purpose=purpose, limit=limit, order=order, after=after, owner=owner
        )
    return [file_object(r) for r in page], has_more


async def get_record(store: Store, file_id: str) -> FileRecord:
    """The file's record; 404 ``not_found`` when there is none or it belongs to another key."""
    async with store.tx() as conn:
        record = await store_files.get_file(conn, file_id)
    if record is None or not accounts.visible(record.owner_key_id):
        raise not_found(file_id)
    return record


async def retrieve_file(store: Store, file_id: str) -> dict[str, Any]:
    """The FileObject of ``file_id``; 404 ``not_found``."""
    return file_object(await get_record(store, file_id))


def download_name(record: FileRecord) -> str:
    """The name a download of the file is saved under: the name it was uploaded with, else ``<file id>.jsonl``."""
    return record.filename or f"{record.id}.jsonl"


async def open_content(store: Store, file_id: str) -> tuple[FileRecord, AsyncIterator[bytes]]:
    """The record and an iterator of the file's exact bytes (1 MiB pieces, one short read each).

    Raises 404 ``not_found`` for no record, 404 ``file_expired`` when the content is gone (:func:`content_expired`;
    the record stays).
    """
    record = await get_record(store, file_id)
    if content_expired(record, now()):
        raise FileExpiredError(f"The file {file_id} has expired; its content is no longer available.", param="file_id")
    return record, store.file_content(file_id)


async def delete_file(store: Store, file_id: str) -> dict[str, Any]:
    """Delete the file (record and bytes); returns ``{id, object: "file", deleted: true}``.

    Raises 404 ``not_found``, and 409 ``file_in_use`` while a batch that has not finished reads it.
    """
    async with store.tx() as conn:
        record = await store_files.get_file(conn, file_id, lock=True)  # a batch create waits for this delete
        if record is None or not accounts.visible(record.owner_key_id):
            raise not_found(file_id)
        reading = await store_files.referencing_active_batch(conn, file_id)
        if reading is not None:
            which = f"batch {reading.id}" if accounts.visible(reading.owner_key_id) else "another key's batch"
            raise ConflictError(
                f"The file {file_id} is the input of {which}, which has not finished.",
                param="file_id",
                code="file_in_use",
            )
        await store_files.delete_file(conn, file_id)
    return FileDeleted(id=file_id).model_dump()
