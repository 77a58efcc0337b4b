"""Streaming multipart upload with the limits of DESIGN §6 checked while the bytes arrive.

The ``file`` part is written to a temporary file under the data directory (bounded memory) while its bytes, request
lines and longest line are counted. Past a limit the rest of the body is still read (and counted, not stored) so
that the 413 can name the measured value; nothing is stored then.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header

from ..errors import InvalidRequestError, PayloadTooLargeError
from ..settings import Settings

MAX_FIELD_BYTES = 65536


@dataclass
class LineCounter:
    """Counts bytes, request lines (non-blank) and the longest line of a stream fed in pieces."""

    bytes: int = 0  # in this class, the builtin type is ``builtins.bytes``
    rows: int = 0
    longest_line: int = 0
    longest_line_number: int = 0
    _line_len: int = 0
    _line_blank: bool = True
    _line_number: int = 1

    def feed(self, data: builtins.bytes) -> None:
        """Count one piece of the stream."""
        self.bytes += len(data)
        parts = data.split(b"\n")
        for i, part in enumerate(parts):
            self._line_len += len(part)
            if self._line_blank and part.strip():
                self._line_blank = False
            if i < len(parts) - 1:
                self._end_line()

    def _end_line(self) -> None:
        if self._line_len > self.longest_line:
            self.longest_line, self.longest_line_number = self._line_len, self._line_number
        if not self._line_blank:
            self.rows += 1
        self._line_len, self._line_blank = 0, True
        self._line_number += 1

    def finish(self) -> None:
        if self._line_len or not self._line_blank:
            self._end_line()


@dataclass
class Upload:
    """The parsed form: small text fields, and the file part spooled to ``path``."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    sha256: Any = field(default_factory=hashlib.sha256)
    path: Path | None = None
    counter: LineCounter = field(default_factory=LineCounter)

    def discard(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


@dataclass
class _Part:
    """The multipart part being parsed: its headers, field name, and where its bytes go (the spooled file for
    ``file``, ``value`` for a small field, nowhere for a repeated field)."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""
    name: str = ""
    value: bytes = b""
    sink: BinaryIO | None = None
    skip: bool = False


async def receive_upload(
    content_type: str,
    body: AsyncIterator[bytes],
    *,
    tmp_dir: Path,
    max_file_bytes: int,
    max_line_bytes: int,
    max_rows: int,
) -> Upload:
    """Parse a ``multipart/form-data`` body from ``body`` chunks.

    Raises :class:`InvalidRequestError` (400) for a body that is not multipart or that repeats a field (two
    ``file`` parts: the field is named), and :class:`PayloadTooLargeError`
    (413) naming the limit and the measured value when the file part has more than ``max_file_bytes`` bytes, a line
    longer than ``max_line_bytes`` or more than ``max_rows`` request lines. On error nothing is left on disk.
    """
    ctype, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise InvalidRequestError(
            "Upload the file as multipart/form-data with the fields 'file' and 'purpose'.", param="file"
        )
    tmp_dir.mkdir(parents=True, exist_ok=True)
    upload = Upload()
    part = _Part()
    too_large_field: list[str] = []
    seen: set[str] = set()
    repeated: list[str] = []  # a field sent twice: refused by name, never "the last one wins"

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part.header_value += data[start:end]

    def on_header_end() -> None:
        part.headers[part.header_name.lower()] = part.header_value
        part.header_name, part.header_value = b"", b""

    def on_headers_finished() -> None:
        _, disp = parse_options_header(part.headers.get(b"content-disposition", b""))
        name = disp.get(b"name", b"").decode("utf-8", "replace")
        part.name, part.value = name, b""
        part.skip = name in seen
        if part.skip:
            repeated.append(name)
            return
        seen.add(name)
        if name == "file":
            fd, path = tempfile.mkstemp(prefix="upload-", suffix=".part", dir=tmp_dir)
            upload.path = Path(path)
            upload.counter = LineCounter()
            upload.sha256 = hashlib.sha256()
            upload.filename = disp.get(b"filename", b"upload.jsonl").decode("utf-8", "replace") or "upload.jsonl"
            part.sink = os.fdopen(fd, "wb")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.skip:
            return
        piece = data[start:end]
        if part.sink is not None:
            upload.counter.feed(piece)
            upload.sha256.update(piece)
            if upload.counter.bytes <= max_file_bytes:
                part.sink.write(piece)
        else:
            value = part.value + piece
            if len(value) > MAX_FIELD_BYTES:
                too_large_field.append(part.name)
                value = value[:MAX_FIELD_BYTES]
            part.value = value

    def on_part_end() -> None:
        if part.skip:
            part.skip = False
        elif part.sink is not None:
            part.sink.close()
            upload.counter.finish()
            part.sink = None
        elif part.name:
            upload.fields[part.name] = part.value.decode("utf-8", "replace")
        part.headers = {}

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in body:
            parser.write(chunk)
        parser.finalize()
    except PayloadTooLargeError:
        upload.discard()
        raise
    except Exception as exc:
        upload.discard()
        if part.sink is not None:
            part.sink.close()
        raise InvalidRequestError(f"The multipart body could not be parsed: {exc}.", param="file") from None
    if repeated:
        upload.discard()
        raise InvalidRequestError(
            f"The form has more than one '{repeated[0]}' part; send each field once (one file per upload).",
            param=repeated[0],
        )
    if too_large_field:
        upload.discard()
        raise InvalidRequestError(f"The form field '{too_large_field[0]}' is too long.", param=too_large_field[0])
    c = upload.counter
    if upload.path is not None:
        if c.bytes > max_file_bytes:
            upload.discard()
            raise PayloadTooLargeError(
                f"The file is {c.bytes} bytes; the limit is {max_file_bytes} bytes (BATCH_MAX_FILE_BYTES).",
                param="file",
                code="file_too_large",
            )
        if c.longest_line > max_line_bytes:
            upload.discard()
            raise PayloadTooLargeError(
                f"Line {c.longest_line_number} is {c.longest_line} bytes; the limit is {max_line_bytes} bytes per "
                "line (BATCH_MAX_LINE_BYTES).",
                param="file",
                code="line_too_large",
            )
        if c.rows > max_rows:
            upload.discard()
            raise PayloadTooLargeError(
                f"The file has {c.rows} request lines; the limit is {max_rows} (BATCH_MAX_ROWS).",
                param="file",
                code="too_many_rows",
            )
    return upload


async def receive_batch_upload(content_type: str, body: AsyncIterator[bytes], settings: Settings) -> Upload:
    """:func:`receive_upload` under the server's batch file limits (``BATCH_MAX_FILE_BYTES``, ``BATCH_MAX_LINE_BYTES``,
    ``BATCH_MAX_ROWS``), into ``<data dir>/tmp``: the one way both the Files API and the console take an upload."""
    return await receive_upload(
        content_type,
        body,
        tmp_dir=settings.data_dir / "tmp",
        max_file_bytes=settings.batch_max_file_bytes,
        max_line_bytes=settings.batch_max_line_bytes,
        max_rows=settings.batch_max_rows,
    )
