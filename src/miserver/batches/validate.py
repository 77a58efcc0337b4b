"""Streamed validation of a batch input file (DESIGN §4, "Validation").

The file is read chunk by chunk; each physical line is numbered from 1 (blank lines keep their number but are not
requests). A line becomes a valid row or an error row whose error is exactly what the synchronous route would have
answered for the same body (the endpoint service's own ``check`` in strict mode).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    APIError,
    InvalidRequestError,
    MissingParameterError,
    UnknownParameterError,
)
from ..ids import random_id
from ..protocol.common import check_text, find_unpaired_surrogate
from ..services.context import ServiceContext
from ..services.registry import SERVICES

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


def error_line(custom_id: str | None, line: int, error: APIError) -> str:
    """The error-file line of a line refused at validation."""
    return json.dumps(
        {
            "id": random_id("batch_req_"),
            "custom_id": custom_id,
            "response": {"status_code": error.status_code, "request_id": random_id("req_"), "body": error.envelope()},
            "error": None,
            "millm": {"line": line},
        },
        ensure_ascii=False,
    )


def check_line(
    ctx: ServiceContext, endpoint: str, raw: bytes, seen: set[str]
) -> tuple[str | None, dict[str, Any] | None, str | None, APIError | None]:
    """Validate one non-blank line. Returns ``(custom_id, body, model, error)``; ``error`` is None when valid."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, None, None, InvalidRequestError(
            f"Line is not valid UTF-8 (byte {exc.start}).", code="invalid_encoding"
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, None, None, InvalidRequestError(f"Line is not valid JSON: {exc.msg}.", code="invalid_json_line")
    except RecursionError:
        return None, None, None, InvalidRequestError("Line is nested too deeply to be read.", code="invalid_json_line")
    if not isinstance(obj, dict):
        return None, None, None, InvalidRequestError("Line must be a JSON object.", code="invalid_json_line")
    try:  # the line's own fields; the body's strings are the service's to check (named as the route names them)
        check_text({k: v for k, v in obj.items() if k != "body"})
    except InvalidRequestError as exc:
        cid = obj.get("custom_id")
        clean = cid if isinstance(cid, str) and find_unpaired_surrogate(cid) is None else None
        return clean, None, None, exc
    cid = obj.get("custom_id")
    custom_id = cid if isinstance(cid, str) else None
    for key in LINE_KEYS:
        if key not in obj:
            return custom_id, None, None, MissingParameterError(f"Missing required parameter: '{key}'.", param=key)
    if not isinstance(cid, str):
        return None, None, None, InvalidRequestError(
            "'custom_id' must be a string.", param="custom_id", code="invalid_type"
        )
    if not cid:
        return None, None, None, InvalidRequestError("'custom_id' must be a non-empty string.", param="custom_id")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        return None, None, None, InvalidRequestError(
            f"'custom_id' is {len(cid)} characters; at most {MAX_CUSTOM_ID_CHARS} are allowed.", param="custom_id"
        )
    if cid in seen:
        return cid, None, None, InvalidRequestError(
            f"The custom_id '{cid}' appears more than once in the file.", param="custom_id", code="duplicate_custom_id"
        )
    seen.add(cid)
    extra = [k for k in obj if k not in LINE_KEYS]
    if extra:
        return cid, None, None, UnknownParameterError(f"Unrecognized line field: '{extra[0]}'.", param=extra[0])
    if obj["method"] != "POST":
        return cid, None, None, InvalidRequestError("'method' must be \"POST\".", param="method")
    if obj["url"] != endpoint:
        hint = f" Write it as {endpoint!r}." if isinstance(obj["url"], str) and "/v1" + obj["url"] == endpoint else ""
        return cid, None, None, InvalidRequestError(
            f"The line's url {obj['url']!r} does not match the batch's endpoint {endpoint!r}.{hint}",
            param="url",
            code="invalid_url",
        )
    body = obj["body"]
    if not isinstance(body, dict):
        return cid, None, None, InvalidRequestError("'body' must be a JSON object.", param="body", code="invalid_type")
    if body.get("stream") is True:
        return cid, None, None, InvalidRequestError(
            "Streaming is not supported in a batch: remove 'stream' or set it to false.",
            param="stream",
            code="streaming_unsupported",
        )
    try:
        request, engine = SERVICES[endpoint].check(ctx, body, strict=True)
    except APIError as exc:
        return cid, None, None, exc
    return cid, body, engine.info.model_id, None
