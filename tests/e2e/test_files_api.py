"""Files API end to end (DESIGN §3.1, §6): upload, list, retrieve, content, delete, limits; on SQLite and PostgreSQL.

The tests of this module share one server per database kind, started with limits small enough to reach in a test
(``BATCH_MAX_FILE_BYTES``, ``BATCH_MAX_LINE_BYTES``, ``BATCH_MAX_ROWS``); each test leaves no batch running.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.batches import api_error, chat_body, error_of, jsonl, line, submit, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process, wait_for

DEFAULT_EXPIRY = 2_592_000  # FILE_DEFAULT_EXPIRY_SECONDS
#: Limits (DESIGN §6) set on the server: above what the other tests upload, small enough to exceed quickly.
MAX_FILE, MAX_LINE, MAX_ROWS = 3_000_000, 100_000, 20_000


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {
        "BATCH_MAX_FILE_BYTES": str(MAX_FILE),
        "BATCH_MAX_LINE_BYTES": str(MAX_LINE),
        "BATCH_MAX_ROWS": str(MAX_ROWS),
    }
    root = tmp_path_factory.mktemp("files-server")
    with tiny_server_process(tiny_model_dir, root, database_url=module_database_url, env=env) as s:
        yield s


def upload(client: openai.OpenAI, data: bytes, name: str = "input.jsonl", **kwargs: object) -> openai.types.FileObject:
    return client.files.create(file=(name, data), purpose="batch", **kwargs)  # type: ignore[arg-type]


def all_file_ids(client: openai.OpenAI) -> list[str]:
    page = client.files.list(limit=10000)
    assert page.has_more is False
    return [f.id for f in page.data]


def test_upload_returns_the_file_object(server: ServerProcess) -> None:
    client = server.client()
    data = jsonl([line("a", chat_body("hello"))])
    f = upload(client, data, name="my input ☃.jsonl")
    assert f.id.startswith("file-")
    assert f.object == "file"
    assert f.bytes == len(data)
    assert f.filename == "my input ☃.jsonl"
    assert f.purpose == "batch"
    assert f.status == "processed"
    assert f.expires_at == f.created_at + DEFAULT_EXPIRY
    assert client.files.retrieve(f.id) == f
    assert client.files.content(f.id).content == data


def test_content_round_trips_exact_bytes(server: ServerProcess) -> None:
    client, http = server.client(), server.http()
    # A BOM, CRLF, blank lines, multi-byte characters, a byte that is not UTF-8 and no final newline: all kept.
    small = '\ufeff{"q": "héllo ☃ 🎉 日本語"}\r\n\n  \n{"x": "\\u00e9 é"}\r\n'.encode() + b"\xff\xfe raw" + b"\n{}"
    # Over 1 MiB with pseudo-random bytes, so that the content spans several storage chunks.
    big = random.Random(0).randbytes(2_500_000)
    for data in (small, big):
        f = upload(client, data)
        assert f.bytes == len(data)
        assert client.files.content(f.id).content == data
        response = http.get(f"/v1/files/{f.id}/content")
        assert response.status_code == 200
        assert response.headers["content-type"].split(";")[0].strip() == "application/jsonl"
        assert response.content == data
        assert response.headers["x-request-id"]


def test_list_newest_first_and_paginates_without_gaps(server: ServerProcess) -> None:
    client = server.client()
    mine = [upload(client, jsonl([{"n": i}])).id for i in range(5)]

    everything = client.files.list(purpose="batch")
    assert everything.has_more is False
    ids = [f.id for f in everything.data]
    assert len(ids) == len(set(ids))
    assert ids[:5] == mine[::-1], "newest first"
    created = [f.created_at for f in everything.data]
    assert created == sorted(created, reverse=True)
    raw = server.http().get("/v1/files", params={"purpose": "batch"}).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", ids[0], ids[-1], False)

    # Page by hand with `after`: the pages concatenate to the whole list; has_more is false only on the last.
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        page = client.files.list(purpose="batch", limit=2, **({"after": after} if after else {}))
        got = [f.id for f in page.data]
        assert 1 <= len(got) <= 2
        pages.append(got)
        after = got[-1]
        if not page.has_more:
            break
        assert len(got) == 2
    assert [i for p in pages for i in p] == ids
    assert len(pages) == (len(ids) + 1) // 2

    # The SDK's auto-pagination follows `after` the same way.
    assert [f.id for f in client.files.list(purpose="batch", limit=2)] == ids
    # Oldest first on request.
    assert [f.id for f in client.files.list(purpose="batch", order="asc")] == ids[::-1]
    # limit=1 after the newest gives the second newest.
    assert [f.id for f in client.files.list(purpose="batch", limit=1, after=ids[0]).data] == ids[1:2]


@pytest.mark.parametrize("limit", [0, 10001])
def test_list_limit_out_of_range(server: ServerProcess, limit: int) -> None:
    exc = api_error(server.client().files.list, limit=limit)
    assert exc.status_code == 400
    assert error_of(exc)["param"] == "limit"


def test_retrieve_and_content_of_unknown_file_are_404(server: ServerProcess) -> None:
    client = server.client()
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        exc = api_error(call, "file-doesnotexist")
        assert exc.status_code == 404, call
        assert exc.response.headers["x-request-id"]


def test_delete_then_404(server: ServerProcess) -> None:
    client = server.client()
    f = upload(client, jsonl([{"x": 1}]))
    deleted = client.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    assert api_error(client.files.retrieve, f.id).status_code == 404
    assert api_error(client.files.content, f.id).status_code == 404
    assert api_error(client.files.delete, f.id).status_code == 404
    assert f.id not in all_file_ids(client)


def test_delete_input_of_a_running_batch_is_409(server: ServerProcess) -> None:
    client = server.client()
    # Enough work (20 rows of 16 tokens) that the batch cannot end between its creation and the delete.
    rows = [line(f"r{i}", chat_body(f"Tell a story {i}", max_tokens=16)) for i in range(20)]
    batch = submit(client, jsonl(rows))
    exc = api_error(client.files.delete, batch.input_file_id)
    still = client.batches.retrieve(batch.id)
    assert still.status not in ("completed", "failed", "expired", "cancelled"), "the batch ended too soon for the test"
    assert exc.status_code == 409
    err = error_of(exc)
    assert err["code"] == "file_in_use"
    assert batch.id in err["message"]
    assert client.files.retrieve(batch.input_file_id).id == batch.input_file_id  # still there

    client.batches.cancel(batch.id)
    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled"
    # Once the batch is terminal the file may go.
    assert client.files.delete(batch.input_file_id).deleted is True


@pytest.mark.parametrize("purpose", ["assistants", "fine-tune", "batch_output", "user_data", "vision"])
def test_purpose_other_than_batch_is_400(server: ServerProcess, purpose: str) -> None:
    client = server.client()
    before = all_file_ids(client)
    exc = api_error(client.files.create, file=("x.jsonl", b"{}\n"), purpose=purpose)  # type: ignore[arg-type]
    assert exc.status_code == 400
    assert error_of(exc)["param"] == "purpose"
    assert all_file_ids(client) == before


def test_missing_file_or_purpose_is_400(server: ServerProcess) -> None:
    client, http = server.client(), server.http()
    before = all_file_ids(client)
    # multipart with only the purpose field
    r = http.post("/v1/files", files={"purpose": (None, "batch")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "file"
    # multipart with only the file
    r = http.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "purpose"
    # not multipart at all
    r = http.post("/v1/files", json={"purpose": "batch"})
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"]
    assert all_file_ids(client) == before


def test_expires_after(server: ServerProcess) -> None:
    client, http = server.client(), server.http()
    for seconds in (3600, 2_592_000):
        f = upload(client, b"{}\n", expires_after={"anchor": "created_at", "seconds": seconds})
        assert f.expires_at == f.created_at + seconds
        assert client.files.retrieve(f.id).expires_at == f.expires_at
    before = all_file_ids(client)
    for seconds in ("3599", "2592001", "soon"):
        r = http.post(
            "/v1/files",
            files={
                "file": ("x.jsonl", b"{}\n"),
                "purpose": (None, "batch"),
                "expires_after[anchor]": (None, "created_at"),
                "expires_after[seconds]": (None, seconds),
            },
        )
        assert r.status_code == 400, (seconds, r.text)
        assert r.json()["error"]["param"].startswith("expires_after"), r.text
    r = http.post(
        "/v1/files",
        files={
            "file": ("x.jsonl", b"{}\n"),
            "purpose": (None, "batch"),
            "expires_after[anchor]": (None, "last_active_at"),
            "expires_after[seconds]": (None, "7200"),
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("expires_after"), r.text
    assert all_file_ids(client) == before


# -- limits (DESIGN §6) ---------------------------------------------------------------------------------------


def _json_line(n: int) -> bytes:
    """A line of exactly ``n`` bytes (without its newline)."""
    head = b'{"pad": "'
    tail = b'"}'
    return head + b"x" * (n - len(head) - len(tail)) + tail


def _assert_413_stores_nothing(server: ServerProcess, data: bytes, *numbers: int) -> dict[str, object]:
    client = server.client()
    before = all_file_ids(client)
    exc = api_error(client.files.create, file=("big.jsonl", data), purpose="batch")
    assert exc.status_code == 413
    err = error_of(exc)
    message = str(err["message"]).replace(",", "").replace("_", "")  # "3,000,000" names 3000000 too
    for n in numbers:
        assert str(n) in message, (n, err)
    assert all_file_ids(client) == before, "a refused upload must store nothing"
    tmp = server.data_dir / "tmp"
    assert not tmp.exists() or not any(tmp.iterdir()), "the spooled upload must be removed"
    return err


def test_file_bytes_limit(server: ServerProcess) -> None:
    # Short lines, few rows: only the size is over the limit. Blank lines are bytes but not rows.
    data = _json_line(100) + b"\n" + b"\n" * (MAX_FILE + 1 - 101)
    assert len(data) == MAX_FILE + 1
    _assert_413_stores_nothing(server, data, MAX_FILE, MAX_FILE + 1)
    # Exactly at the limit is accepted.
    ok = data[:-1]
    assert server.client().files.create(file=("ok.jsonl", ok), purpose="batch").bytes == MAX_FILE


def test_line_bytes_limit(server: ServerProcess) -> None:
    data = _json_line(50) + b"\n" + _json_line(MAX_LINE + 57) + b"\n"
    _assert_413_stores_nothing(server, data, MAX_LINE, MAX_LINE + 57)
    # A line of exactly the limit is accepted (the newline is not part of the line).
    ok = _json_line(MAX_LINE) + b"\n"
    assert server.client().files.create(file=("ok.jsonl", ok), purpose="batch").bytes == len(ok)


def test_rows_limit(server: ServerProcess) -> None:
    data = b"{}\n" * (MAX_ROWS + 2)
    _assert_413_stores_nothing(server, data, MAX_ROWS, MAX_ROWS + 2)
    # The limit itself is accepted, and blank lines do not count as rows.
    ok = b"{}\n\n" * MAX_ROWS
    assert server.client().files.create(file=("ok.jsonl", ok), purpose="batch").bytes == len(ok)


def test_limit_refusal_answers_with_request_id_and_server_keeps_working(server: ServerProcess) -> None:
    http = server.http()
    r = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * (MAX_FILE + 1)), "purpose": (None, "batch")})
    assert r.status_code == 413, r.text
    assert r.headers["x-request-id"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    wait_for(lambda: http.get("/api/health").status_code == 200, timeout=10)
