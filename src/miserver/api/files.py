"""Files API routes (DESIGN §3.1): upload, list, retrieve, content, delete. The rules are in
``services/batch_api/files.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ..http_headers import content_disposition
from ..protocol.batches import BatchInputLine, BatchOutputLine
from ..protocol.files import FileDeleted, FileList, FileObject, FileUploadForm
from ..services.batch_api import files as service
from ..services.batch_api.files import download_name
from .common import list_object, state
from .openapi import CHANGE_ERRORS, LOOKUP_ERRORS, documented
from .upload import receive_batch_upload

router = APIRouter()


@router.post("/v1/files")
@documented(
    form=FileUploadForm, lines=BatchInputLine, ok=FileObject, errors=(400, 409, 413, 500), headers=("idempotency",)
)
async def upload_file(request: Request) -> dict[str, Any]:
    """Multipart ``file`` + ``purpose`` (+ ``expires_after[...]``) -> the FileObject; limits checked while streaming."""
    st = state(request)
    s = st.settings
    upload = await receive_batch_upload(request.headers.get("content-type", ""), request.stream(), s)
    try:
        form = service.FileUpload(
            fields=upload.fields,
            filename=upload.filename,
            path=upload.path,
            content_sha256=upload.sha256.hexdigest(),
            idempotency_key=request.headers.get("idempotency-key"),
        )
        return await service.create_file(st.store, form, default_expiry_seconds=s.file_default_expiry_seconds)
    finally:
        upload.discard()


@router.get("/v1/files")
@documented(ok=FileList)
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = service.LIST_LIMIT_MAX,
    order: str = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The list envelope of FileObjects, newest first by default."""
    data, has_more = await service.list_files(
        state(request).store, purpose=purpose, limit=limit, order=order, after=after
    )
    return list_object(data, has_more)


@router.get("/v1/files/{file_id}")
@documented(ok=FileObject, errors=LOOKUP_ERRORS)
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    """The FileObject."""
    return await service.retrieve_file(state(request).store, file_id)


@router.get("/v1/files/{file_id}/content")
@documented(ok_media="application/jsonl", lines=BatchOutputLine, errors=LOOKUP_ERRORS)
async def file_content(file_id: str, request: Request) -> Response:
    """The exact bytes, streamed as ``application/jsonl``; 404 ``file_expired`` once the content is gone."""
    record, content = await service.open_content(state(request).store, file_id)
    headers = {"Content-Length": str(record.bytes), "Content-Disposition": content_disposition(download_name(record))}
    return StreamingResponse(content, media_type="application/jsonl", headers=headers)


@router.delete("/v1/files/{file_id}")
@documented(ok=FileDeleted, errors=CHANGE_ERRORS)
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    """``{id, object: "file", deleted: true}``; 409 ``file_in_use`` while an unfinished batch reads the file."""
    return await service.delete_file(state(request).store, file_id)
