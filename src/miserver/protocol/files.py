"""Pydantic models of the Files API (``/v1/files``). Source: the OpenAI Files API reference, DESIGN §3.1."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .common import ResponseModel

FilePurpose = Literal["batch", "batch_output"]

#: Bounds of an expiry in seconds after ``created_at``: a file's ``expires_after[seconds]`` and a batch's
#: ``output_expires_after.seconds`` (1 hour to 30 days, inclusive).
EXPIRES_AFTER_MIN_SECONDS = 3600
EXPIRES_AFTER_MAX_SECONDS = 2_592_000


class FileObject(ResponseModel):
    """A stored file. ``bytes`` is the exact content length; times are integer Unix seconds."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(ResponseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileList(ResponseModel):
    """``GET /v1/files``: a page of FileObjects (the OpenAI list envelope)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileUploadForm(BaseModel):
    """The ``multipart/form-data`` fields of ``POST /v1/files``, as the OpenAPI document describes them. The form is
    read as a stream (``api/upload.py``) and its fields checked by ``services/batch_api/files.py`` with the bounds
    above."""

    file: bytes = Field(json_schema_extra={"format": "binary", "type": "string"})
    purpose: Literal["batch"]
    expires_after_anchor: Literal["created_at"] | None = Field(None, alias="expires_after[anchor]")
    expires_after_seconds: int | None = Field(
        None, alias="expires_after[seconds]", ge=EXPIRES_AFTER_MIN_SECONDS, le=EXPIRES_AFTER_MAX_SECONDS
    )
