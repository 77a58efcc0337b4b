"""Files API (DESIGN §3.1): upload, list, retrieve, content, delete."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ..errors import ConflictError, FileExpiredError, InvalidRequestError, MissingParameterError, NotFoundError
from ..ids import now, ordered_id
from ..protocol.files import FileDeleted, FileObject
from ..store import files as store_files
from ..store import idempotency
from ..store.files import FileRecord
from .common import list_object, state
from .idempotency import idempotency_key, key_in_flight, replay
from .upload import receive_upload

router = APIRouter()

READ_BYTES = 1 << 20


def file_object(record: FileRecord) -> dict[str, Any]:
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


def _int_field(fields: dict[str, str], name: str) -> int | None:
    if name not in fields:
        return None
    try:
        return int(fields[name])
    except ValueError:
        raise InvalidRequestError(f"Invalid '{name}': expected an integer.", param=name) from None


def _expiry(fields: dict[str, str], created: int, default_seconds: int) -> int:
    anchor = fields.get("expires_after[anchor]")
    seconds = _int_field(fields, "expires_after[seconds]")
    if anchor is None and seconds is None:
        return created + default_seconds
    if anchor != "created_at":
        raise InvalidRequestError("Invalid 'expires_after[anchor]': must be 'created_at'.", param="expires_after[anchor]")
    if seconds is None:
        raise MissingParameterError("Missing required parameter: 'expires_after[seconds]'.", param="expires_after[seconds]")
    if not 3600 <= seconds <= 2_592_000:
        raise InvalidRequestError(
            "Invalid 'expires_after[seconds]': must be between 3600 and 2592000.", param="expires_after[seconds]"
        )
    return created + seconds


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    st = state(request)
    s = st.settings
    upload = await receive_upload(
        request.headers.get("content-type", ""),
        request.stream(),
        tmp_dir=s.data_dir / "tmp",
        max_file_bytes=s.batch_max_file_bytes,
        max_line_bytes=s.batch_max_line_bytes,
        max_rows=s.batch_max_rows,
    )
    try:
        key = idempotency_key(request)
        body_sha256 = hashlib.sha256(
            json.dumps([upload.sha256.hexdigest(), upload.filename, sorted(upload.fields.items())]).encode()
        ).hexdigest()
        if key is not None:
            async with st.store.tx() as conn:
                first = replay(await idempotency.lookup(conn, "files", key), body_sha256)
            if first is not None:
                return first
        purpose = upload.fields.get("purpose")
        if purpose is None:
            raise MissingParameterError("Missing required parameter: 'purpose'.", param="purpose")
        if purpose != "batch":
            raise InvalidRequestError(
                f"Invalid 'purpose': {purpose!r}. This server accepts 'batch'.", param="purpose"
            )
        if upload.path is None:
            raise MissingParameterError("Missing required parameter: 'file'.", param="file")
        created = now()
        expires_at = _expiry(upload.fields, created, s.file_default_expiry_seconds)

        def chunks() -> Any:
            assert upload.path is not None
            with upload.path.open("rb") as fh:
                while piece := fh.read(READ_BYTES):
                    yield piece

        async with st.store.tx() as conn:
            record = await store_files.insert_file(
                conn,
                file_id=ordered_id("file-"),
                purpose="batch",
                filename=upload.filename or "upload.jsonl",
                created_at=created,
                expires_at=expires_at,
                chunks=chunks(),
            )
            answer = file_object(record)
            if key is not None:
                try:
                    await idempotency.remember(conn, "files", key, body_sha256, 200, answer, created)
                except idempotency.KeyTaken:
                    raise key_in_flight(key) from None
    finally:
        upload.discard()
    return answer


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: int = 10000, order: str = "desc", after: str | None = None
) -> dict[str, Any]:
    if not 1 <= limit <= 10000:
        raise InvalidRequestError("Invalid 'limit': must be between 1 and 10000.", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("Invalid 'order': must be 'asc' or 'desc'.", param="order")
    async with state(request).store.tx() as conn:
        if after is not None and await store_files.get_file(conn, after) is None:
            raise InvalidRequestError(f"Invalid 'after': no file with id {after!r}.", param="after")
        page, has_more = await store_files.list_files(conn, purpose=purpose, limit=limit, order=order, after=after)
    data = [file_object(r) for r in page]
    return list_object(data, has_more)


async def _get(request: Request, file_id: str) -> FileRecord:
    async with state(request).store.tx() as conn:
        record = await store_files.get_file(conn, file_id)
    if record is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id", code="not_found")
    return record


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    return file_object(await _get(request, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    record = await _get(request, file_id)
    if record.content_deleted_at is not None or (record.expires_at is not None and record.expires_at <= now()):
        raise FileExpiredError(f"The file {file_id} has expired; its content is no longer available.", param="file_id")
    return StreamingResponse(
        store_files.iter_content(state(request).store.engine, file_id),
        media_type="application/jsonl",
        headers={"Content-Length": str(record.bytes)},
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    async with state(request).store.tx() as conn:
        if await store_files.get_file(conn, file_id) is None:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id", code="not_found")
        batch_id = await store_files.referencing_active_batch(conn, file_id)
        if batch_id is not None:
            raise ConflictError(
                f"The file {file_id} is the input of batch {batch_id}, which has not finished.",
                param="file_id",
                code="file_in_use",
            )
        await store_files.delete_file(conn, file_id)
    return FileDeleted(id=file_id).model_dump()
