"""Streaming upload: limits are enforced while the bytes arrive, and the 413 names the limit and the measured value."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from miserver.api.upload import LineCounter, receive_upload
from miserver.errors import InvalidRequestError, PayloadTooLargeError

BOUNDARY = "xyzBOUNDARY"


def form(content: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


async def pieces(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def upload(tmp_path: Path, content: bytes, **limits: int):  # type: ignore[no-untyped-def]
    args = {"max_file_bytes": 10_000, "max_line_bytes": 1000, "max_rows": 100} | limits
    return await receive_upload(
        f"multipart/form-data; boundary={BOUNDARY}", pieces(form(content)), tmp_dir=tmp_path, **args
    )


def test_line_counter_counts_request_lines_only() -> None:
    c = LineCounter()
    for piece in (b'{"a":1}\n\n  \n{"b"', b":2}\r\n", b"{}"):
        c.feed(piece)
    c.finish()
    assert (c.bytes, c.rows) == (23, 3)
    assert c.longest_line == 8 and c.longest_line_number == 4


async def test_upload_spools_exact_bytes(tmp_path: Path) -> None:
    content = '{"x": "h\u00e9llo"}\n'.encode() * 3
    up = await upload(tmp_path, content)
    assert up.fields == {"purpose": "batch"} and up.filename == "in.jsonl"
    assert up.path is not None and up.path.read_bytes() == content
    up.discard()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("limits", "content", "code", "numbers"),
    [
        ({"max_file_bytes": 50}, b"{}\n" * 40, "file_too_large", ("120 bytes", "50 bytes")),
        (
            {"max_line_bytes": 10},
            b"{}\n" + b"{" + b" " * 20 + b"}\n",
            "line_too_large",
            ("Line 2", "22 bytes", "10 bytes"),
        ),
        ({"max_rows": 3}, b"{}\n" * 5, "too_many_rows", ("5 request lines", "limit is 3")),
    ],
)
async def test_limits_name_limit_and_measured_value(
    tmp_path: Path, limits: dict[str, int], content: bytes, code: str, numbers: tuple[str, ...]
) -> None:
    with pytest.raises(PayloadTooLargeError) as info:
        await upload(tmp_path, content, **limits)
    assert info.value.code == code and info.value.status_code == 413
    for text in numbers:
        assert text in info.value.message
    assert list(tmp_path.iterdir()) == []  # nothing stored


async def test_not_multipart_is_400(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError):
        await receive_upload(
            "application/json", pieces(b"{}"), tmp_dir=tmp_path, max_file_bytes=1, max_line_bytes=1, max_rows=1
        )
