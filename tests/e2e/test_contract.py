"""The edges of the Batch contract a user meets first: encodings, the same refusal as the synchronous route,
idempotent retries, gzip downloads, cancel at the wrong moment, and a batch whose every row fails."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, wait_for

LONG = "word " * 600  # about 600 tokens: longer than the tiny model's 512-token context

#: Bodies every one of which the synchronous route refuses; the batch must refuse them identically.
REFUSED: list[dict[str, Any]] = [
    {"model": "tiny"},
    {"model": "tiny", "messages": "hello"},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "foo": 1},
    {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 7},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
    {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 2**70},
    {"model": "tiny", "messages": [{"role": "user", "content": None}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}},
]


def test_batch_refuses_exactly_like_the_synchronous_route(module_server: ServerProcess) -> None:
    http = module_server.http()
    sync = []
    for body in REFUSED:
        r = http.post("/v1/chat/completions", json=body, headers={"X-miLLM-Strict": "true"})
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        sync.append((r.status_code, r.json()["error"]))
    client = module_server.client()
    lines = [line(f"bad-{i}", body) for i, body in enumerate(REFUSED)] + [line("good", chat_body("hi"))]
    done = wait_terminal(client, submit(client, jsonl(lines)).id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.failed) == (len(REFUSED) + 1, len(REFUSED))
    errors = read_lines(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == [f"bad-{i}" for i in range(len(REFUSED))]
    # the same status, code and message; the param named inside the line's body (OpenAI's Batch API form)
    for (status, error), got in zip(sync, errors, strict=True):
        assert got["response"]["status_code"] == status
        assert got["response"]["body"]["error"] == {**error, "param": f"body.{error['param']}"}
    assert done.errors is not None and done.errors.data is not None
    assert [(e.code, e.param, e.line) for e in done.errors.data] == [
        (err["code"], f"body.{err['param']}", i + 1) for i, (_, err) in enumerate(sync)
    ]


def test_encodings_blank_lines_and_line_numbers(module_server: ServerProcess) -> None:
    client = module_server.client()
    ok = json.dumps(line("a", chat_body("h\u00e9llo \u2603"))).encode()
    data = (
        b"\xef\xbb\xbf"
        + ok
        + b"\r\n"  # BOM and CRLF
        + b"\r\n   \n"  # blank lines: skipped, not counted, but numbered
        + json.dumps(line("b", chat_body("x"))).encode()[:-1]
        + b"\xff}\n"  # invalid UTF-8
        + json.dumps(line("c" * 65, chat_body("x"))).encode()
        + b"\n"  # custom_id too long
        + json.dumps(line("d", chat_body("x"), url="/chat/completions")).encode()
        + b"\n"
        + json.dumps(line("e", chat_body("x", stream=True, stream_options={"include_usage": True}))).encode()
    )
    done = wait_terminal(client, submit(client, data).id)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 1, 4)
    assert done.errors is not None and done.errors.data is not None
    got = [(e.code, e.param, e.line) for e in done.errors.data]
    assert got == [
        ("invalid_encoding", None, 4),
        ("invalid_value", "custom_id", 5),
        ("invalid_url", "url", 6),
        ("streaming_unsupported", "body.stream", 7),
    ]
    assert "'/v1/chat/completions'" in done.errors.data[2].message  # the hint names the right url
    out = read_lines(client, done.output_file_id)
    assert out[0]["custom_id"] == "a"


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty_file"),
        (b"\n  \n\r\n", "empty_file"),
        ('{"custom_id": "a"}\n'.encode("utf-16"), "invalid_encoding"),
    ],
)
def test_files_that_fail_the_whole_batch(module_server: ServerProcess, data: bytes, code: str) -> None:
    client = module_server.client()
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "failed" and done.failed_at is not None
    assert done.errors is not None and done.errors.data is not None
    assert [e.code for e in done.errors.data] == [code]


def test_idempotency_keys(module_server: ServerProcess) -> None:
    http = module_server.http()
    data = jsonl([line("a", chat_body("hi"))])

    def upload(content: bytes, key: str) -> httpx.Response:
        return http.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", content)},
            headers={"Idempotency-Key": key},
        )

    files_before = len(http.get("/v1/files").json()["data"])
    batches_before = len(http.get("/v1/batches", params={"limit": 100}).json()["data"])
    first = upload(data, "up-1")
    assert first.status_code == 200
    assert upload(data, "up-1").json() == first.json()
    reused = upload(data + data, "up-1")
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused"
    assert len(http.get("/v1/files").json()["data"]) == files_before + 1

    body = {"input_file_id": first.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    b1 = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "b-1"})
    b2 = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "b-1"})
    assert b1.status_code == b2.status_code == 200 and b1.json()["id"] == b2.json()["id"]
    other = http.post("/v1/batches", json={**body, "completion_window": "48h"}, headers={"Idempotency-Key": "b-1"})
    assert other.status_code == 409
    assert wait_terminal(module_server.client(), b1.json()["id"]).status == "completed"
    assert len(http.get("/v1/batches", params={"limit": 100}).json()["data"]) == batches_before + 1


def test_gzip_download_and_exact_bytes(module_server: ServerProcess) -> None:
    client = module_server.client()
    data = jsonl(line(f"r{i}", chat_body(f"\u00fcn\u00efc\u00f8de {i}")) for i in range(20))
    done = wait_terminal(client, submit(client, data).id)
    meta = client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    raw = httpx.get(
        f"{module_server.base_url}/v1/files/{done.output_file_id}/content", headers={"Accept-Encoding": "gzip"}
    )
    assert raw.headers.get("content-encoding") == "gzip"
    assert raw.headers["content-type"].startswith("application/jsonl")
    content = raw.content  # httpx decodes gzip
    assert len(content) == meta.bytes
    assert content.endswith(b"\n") and b"\r" not in content
    assert all(json.loads(x) for x in content.decode("utf-8").split("\n")[:-1])
    plain = httpx.get(
        f"{module_server.base_url}/v1/files/{done.output_file_id}/content", headers={"Accept-Encoding": "identity"}
    )
    assert "content-encoding" not in plain.headers and plain.content == content
    assert gzip.compress(content)  # sanity: the bytes are what was stored


def test_cancel_while_validating_and_every_row_failing(module_server: ServerProcess) -> None:
    client = module_server.client()
    big = jsonl(line(f"r{i}", chat_body(f"row {i}", max_tokens=4)) for i in range(3000))
    batch = submit(client, big)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and counts.completed + counts.failed == counts.total
    assert client.batches.cancel(batch.id).status == "cancelled"  # twice: unchanged

    # every row fails on its own merits (too long for the context): completed, no output file
    failing = submit(client, jsonl(line(f"x{i}", chat_body(LONG, max_tokens=4)) for i in range(3)))
    done = wait_terminal(client, failing.id)
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id is not None
    errors = read_lines(client, done.error_file_id)
    assert [e["response"]["body"]["error"]["code"] for e in errors] == ["context_length_exceeded"] * 3
    refused = wait_for(lambda: _cancel_status(module_server, done.id))
    assert refused == 409


def _cancel_status(server: ServerProcess, batch_id: str) -> int:
    return server.http().post(f"/v1/batches/{batch_id}/cancel").status_code
