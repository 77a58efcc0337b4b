"""The rules of the Files and Batches APIs (``services/batch_api/files.py``, ``services/batch_api/batches.py``,
``services/batch_api/idempotency.py``), in-process: the pure checks without any I/O, the idempotent creates, cancel
and paging
on a throwaway SQLite store. No server is spawned."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa

from miserver.errors import (
    APIError,
    ConflictError,
    FileExpiredError,
    InvalidRequestError,
    MissingParameterError,
    NotFoundError,
    UnknownParameterError,
)
from miserver.services.accounts.keys import Principal, acting_as
from miserver.services.batch_api import batches as batches_service
from miserver.services.batch_api import files as files_service
from miserver.services.batch_api.batches import BatchCreate, check, check_input_file, window_hours
from miserver.services.batch_api.files import FileUpload, check_purpose, content_expired, expires_at
from miserver.services.inference.checks import check_metadata
from miserver.store import Store
from miserver.store import batches as store_batches
from miserver.store.files import FileRecord
from miserver.store.schema import batches as batches_table
from tests.support.inprocess import Clock, installed_clock

DAY = 86_400
DEFAULT_EXPIRY = 30 * DAY
ONE_HOUR = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}


E = TypeVar("E", bound=APIError)


def check_error(info: pytest.ExceptionInfo[E], param: str | None, code: str | None = None) -> None:
    """The refusal names ``param`` (and ``code`` when given)."""
    assert info.value.param == param, info.value.message
    if code is not None:
        assert info.value.code == code, info.value.message


# -- completion_window -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "hours"), [("1h", 1), ("2h", 2), ("24h", 24), ("48h", 48), ("168h", 168)])
def test_window_accepted(window: str, hours: int) -> None:
    assert window_hours(window, 168) == hours


@pytest.mark.parametrize(
    "window",
    ["0h", "169h", "01h", "024h", "24", "24H", "1d", "h", "", " 24h", "24h ", "+24h", "-1h", "2.5h", "24hh", "10000h"],
)
def test_window_refused(window: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        window_hours(window, 168)
    check_error(info, "completion_window", "invalid_value")
    assert repr(window) in info.value.message and "'168h'" in info.value.message


def test_window_bounded_by_the_setting() -> None:
    assert window_hours("48h", 48) == 48
    with pytest.raises(InvalidRequestError) as info:
        window_hours("49h", 48)
    assert "'48h'" in info.value.message
    assert window_hours("9999h", 9999) == 9999


# -- metadata ----------------------------------------------------------------------------------------------------


def test_metadata_at_the_limits_is_accepted() -> None:
    check_metadata(None)
    check_metadata({})
    full = {f"k{i}": "v" for i in range(15)}
    full["k" * 64] = "v" * 512
    check_metadata(full)
    check_metadata({"é" * 64: "☃" * 512})  # characters, not bytes


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"é" * 65: "v"},
    ],
    ids=["17 pairs", "65-char key", "513-char value", "65 non-ascii chars"],
)
def test_metadata_over_the_limits_is_refused(metadata: dict[str, str]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_metadata(metadata)
    check_error(info, "metadata", "invalid_value")


# -- the whole create body -----------------------------------------------------------------------------------------


def body(**override: object) -> dict[str, object]:
    b: dict[str, object] = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    b.update(override)
    return {k: v for k, v in b.items() if v is not None}


def test_check_returns_the_request_and_its_hours() -> None:
    req, hours = check(body(completion_window="2h", metadata={"a": "b"}, pack=True), max_window_hours=168)
    assert hours == 2 and req.metadata == {"a": "b"} and req.pack is True


@pytest.mark.parametrize(
    ("override", "param", "code"),
    [
        ({"endpoint": "/v1/moderations"}, "endpoint", "invalid_value"),
        ({"completion_window": "0h"}, "completion_window", "invalid_value"),
        ({"completion_window": None}, "completion_window", "missing_required_parameter"),
        ({"input_file_id": None}, "input_file_id", "missing_required_parameter"),
        ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 3599}}, "output_expires_after.seconds", None),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 2_592_001}},
            "output_expires_after.seconds",
            None,
        ),
        ({"output_expires_after": {"anchor": "last_active_at", "seconds": 3600}}, "output_expires_after.anchor", None),
        ({"pack": "yes"}, "pack", "invalid_type"),
    ],
)
def test_check_refuses_bad_bodies(override: dict[str, object], param: str, code: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check(body(**override), max_window_hours=168)
    check_error(info, param, code)


@pytest.mark.parametrize("seconds", [3600, 2_592_000])
def test_output_expiry_bounds_are_inclusive(seconds: int) -> None:
    req, _ = check(body(output_expires_after={"anchor": "created_at", "seconds": seconds}), max_window_hours=168)
    assert req.output_expires_after is not None and req.output_expires_after.seconds == seconds


def test_endpoint_is_checked_first_and_the_message_lists_the_endpoints() -> None:
    # the endpoint is checked before the window
    with pytest.raises(InvalidRequestError) as info:
        check(body(endpoint="/v1/moderations", completion_window="0h"), max_window_hours=168)
    check_error(info, "endpoint")
    assert "/v1/responses" in info.value.message and "/anthropic/v1/messages" in info.value.message


def test_an_unknown_field_is_always_refused() -> None:
    with pytest.raises(UnknownParameterError) as info:
        check(body(colour="blue"), max_window_hours=168)
    check_error(info, "colour", "unknown_parameter")


# -- files: purpose, expires_after, expiry of content --------------------------------------------------------------


def test_purpose() -> None:
    assert check_purpose({"purpose": "batch"}) == "batch"
    with pytest.raises(MissingParameterError) as missing:
        check_purpose({})
    check_error(missing, "purpose", "missing_required_parameter")
    for other in ("fine-tune", "batch_output", "assistants", ""):
        with pytest.raises(InvalidRequestError) as info:
            check_purpose({"purpose": other})
        check_error(info, "purpose", "invalid_value")


def test_expires_after_default_and_bounds() -> None:
    assert expires_at({}, 1000, DEFAULT_EXPIRY) == 1000 + DEFAULT_EXPIRY
    for seconds in (3600, 7200, 2_592_000):
        fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(seconds)}
        assert expires_at(fields, 1000, DEFAULT_EXPIRY) == 1000 + seconds


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]", None),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after[seconds]", None),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"}, "expires_after[seconds]", None),
        ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]", "missing_required_parameter"),
        ({"expires_after[seconds]": "7200"}, "expires_after[anchor]", "invalid_value"),
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "7200"}, "expires_after[anchor]", None),
    ],
)
def test_expires_after_refused(fields: dict[str, str], param: str, code: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        expires_at(fields, 1000, DEFAULT_EXPIRY)
    check_error(info, param, code)


def record(*, expires_at: int | None = 2000, deleted: int | None = None, purpose: str = "batch") -> FileRecord:
    return FileRecord(
        id="file-1",
        purpose=purpose,
        filename="in.jsonl",
        bytes=3,
        created_at=1000,
        expires_at=expires_at,
        status="processed",
        status_details=None,
        content_deleted_at=deleted,
    )


def test_content_expired() -> None:
    assert not content_expired(record(), 1999)
    assert content_expired(record(), 2000)  # expired at expires_at itself
    assert content_expired(record(deleted=1500), 1600)  # pruned, whatever the clock says
    assert not content_expired(record(expires_at=None), 10**12)


def test_input_file_checks() -> None:
    check_input_file(record(), "file-1", 1999)
    cases: list[tuple[FileRecord | None, str]] = [
        (None, "No file"),
        (record(purpose="batch_output"), "purpose"),
        (record(), "expired"),
    ]
    for rec, words in cases:
        with pytest.raises(InvalidRequestError) as info:
            check_input_file(rec, "file-1", 2000)
        check_error(info, "input_file_id", "invalid_value")
        assert words in info.value.message


# -- in-process operations on a SQLite store -----------------------------------------------------------------------


@pytest.fixture
def clock() -> Iterator[Clock]:
    with installed_clock() as c:
        yield c


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(f"sqlite:///{tmp_path / 'rules.db'}")
    try:
        yield s
    finally:
        await s.close()


def spool(tmp_path: Path, data: bytes, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def upload(path: Path | None, key: str | None = None, **fields: str) -> FileUpload:
    import hashlib

    digest = hashlib.sha256(path.read_bytes() if path else b"").hexdigest()
    return FileUpload(
        fields={"purpose": "batch", **fields},
        filename="in.jsonl",
        path=path,
        content_sha256=digest,
        idempotency_key=key,
    )


async def count(store: Store, table: str) -> int:
    async with store.read() as conn:
        return int((await conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}"))).scalar_one())


async def create_file(store: Store, form: FileUpload) -> dict[str, object]:
    return await files_service.create_file(store, form, default_expiry_seconds=DEFAULT_EXPIRY)


async def create_batch(store: Store, form: BatchCreate) -> dict[str, object]:
    return await batches_service.create_batch(store, form, max_window_hours=168, pack_default=False)


def batch_form(file_id: str, key: str | None = None, window: str = "24h", lease: str | None = None) -> BatchCreate:
    import json

    raw = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": window})
    return BatchCreate(raw=raw.encode(), caller_lease=lease, idempotency_key=key)


async def test_file_create_replay_and_conflict(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    path = spool(tmp_path, b'{"a": 1}\n')
    first = await create_file(sqlite_store, upload(path, "k-1"))
    assert first["bytes"] == 9 and first["purpose"] == "batch"
    assert await create_file(sqlite_store, upload(path, "k-1")) == first  # replayed, not created again
    assert await count(sqlite_store, "files") == 1
    other = spool(tmp_path, b'{"a": 2}\n', "other.jsonl")
    with pytest.raises(ConflictError) as info:
        await create_file(sqlite_store, upload(other, "k-1"))
    check_error(info, "Idempotency-Key", "idempotency_key_reused")
    with pytest.raises(ConflictError):  # the same bytes under other form fields are another request
        await create_file(sqlite_store, upload(path, "k-1", **ONE_HOUR))
    # without a key every upload is new
    await create_file(sqlite_store, upload(path))
    await create_file(sqlite_store, upload(path))
    assert await count(sqlite_store, "files") == 3


async def test_refused_creates_store_nothing(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    path = spool(tmp_path, b"{}\n")
    with pytest.raises(MissingParameterError) as info:
        await create_file(sqlite_store, upload(None, "k"))
    check_error(info, "file")
    with pytest.raises(InvalidRequestError):
        await create_file(sqlite_store, upload(path, "k", purpose="fine-tune"))
    with pytest.raises(InvalidRequestError) as long_key:
        await create_file(sqlite_store, upload(path, "k" * 257))
    check_error(long_key, "Idempotency-Key")
    with pytest.raises(InvalidRequestError):
        await create_file(sqlite_store, upload(path, ""))
    assert await count(sqlite_store, "files") == 0
    assert await count(sqlite_store, "idempotency_keys") == 0
    # a refused request does not burn its key: the corrected retry creates
    assert (await create_file(sqlite_store, upload(path, "k")))["purpose"] == "batch"
    assert await create_file(sqlite_store, upload(path, "k" * 256)) != {}


async def test_batch_create_replay_and_conflict(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    file_id = str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"), "shared")))["id"])
    first = await create_batch(sqlite_store, batch_form(file_id, "b-1"))
    assert first["status"] == "validating"
    assert first["expires_at"] == int(str(first["created_at"])) + 24 * 3600
    assert await create_batch(sqlite_store, batch_form(file_id, "b-1")) == first
    assert await count(sqlite_store, "batches") == 1
    for changed in (batch_form(file_id, "b-1", window="48h"), batch_form(file_id, "b-1", lease="lease-x")):
        with pytest.raises(ConflictError) as conflict:
            await create_batch(sqlite_store, changed)
        check_error(conflict, "Idempotency-Key", "idempotency_key_reused")
    # keys are per route: the key of the upload names nothing on the batches route
    second = await create_batch(sqlite_store, batch_form(file_id, "shared"))
    assert second["id"] != first["id"] and second["object"] == "batch"
    # the replay comes before every check: the first answer even once the input file has expired
    clock.offset = 31 * DAY
    assert await create_batch(sqlite_store, batch_form(file_id, "b-1")) == first
    with pytest.raises(InvalidRequestError) as expired:
        await create_batch(sqlite_store, batch_form(file_id, "b-2"))
    check_error(expired, "input_file_id")


async def test_batch_create_body_errors(sqlite_store: Store, clock: Clock) -> None:
    with pytest.raises(InvalidRequestError) as bad_json:
        await create_batch(sqlite_store, BatchCreate(raw=b"{nope", idempotency_key="j"))
    check_error(bad_json, None, "invalid_json")
    with pytest.raises(InvalidRequestError) as no_file:
        await create_batch(sqlite_store, batch_form("file-missing"))
    check_error(no_file, "input_file_id")
    assert await count(sqlite_store, "batches") == 0


async def test_key_in_flight(
    sqlite_store: Store, tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests with one key race: the one that stores its answer second gets 409 ``idempotency_key_in_flight``
    and writes nothing; its retry replays the winner's answer."""
    path = spool(tmp_path, b"{}\n")
    from miserver.store import files as store_files

    real_insert = store_files.insert_file
    winner: dict[str, object] = {}

    async def insert_after_the_winner(*args: object, **kwargs: object) -> FileRecord:
        if not winner:
            monkeypatch.setattr(store_files, "insert_file", real_insert)
            winner.update(await create_file(sqlite_store, upload(path, "race")))  # commits first
        return await real_insert(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store_files, "insert_file", insert_after_the_winner)
    with pytest.raises(ConflictError) as info:
        await create_file(sqlite_store, upload(path, "race"))
    check_error(info, "Idempotency-Key", "idempotency_key_in_flight")
    assert await count(sqlite_store, "files") == 1
    assert await create_file(sqlite_store, upload(path, "race")) == winner


async def test_content_and_delete(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    data = b'{"a": 1}\n' * 3
    f = await create_file(sqlite_store, upload(spool(tmp_path, data), **ONE_HOUR))
    file_id = str(f["id"])
    rec, content = await files_service.open_content(sqlite_store, file_id)
    assert rec.bytes == len(data) and b"".join([piece async for piece in content]) == data
    with pytest.raises(NotFoundError) as missing:
        await files_service.open_content(sqlite_store, "file-none")
    check_error(missing, "file_id", "not_found")
    clock.offset = 3600
    with pytest.raises(FileExpiredError) as expired:
        await files_service.open_content(sqlite_store, file_id)
    check_error(expired, "file_id", "file_expired")
    assert (await files_service.retrieve_file(sqlite_store, file_id))["id"] == file_id  # the record stays
    assert await files_service.delete_file(sqlite_store, file_id) == {"id": file_id, "object": "file", "deleted": True}
    with pytest.raises(NotFoundError):
        await files_service.delete_file(sqlite_store, file_id)


async def test_delete_refused_while_a_batch_needs_the_file(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    file_id = str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"))))["id"])
    batch = await create_batch(sqlite_store, batch_form(file_id))
    with pytest.raises(ConflictError) as info:
        await files_service.delete_file(sqlite_store, file_id)
    check_error(info, "file_id", "file_in_use")
    assert str(batch["id"]) in info.value.message


async def test_a_refused_delete_names_another_keys_batch_neutrally(
    sqlite_store: Store, tmp_path: Path, clock: Clock
) -> None:
    """A member's file read by an admin's batch: the member learns that a batch reads it, not that batch's id."""
    member = Principal(key_id="key_member", name="member", admin=False)
    with acting_as(member):
        file_id = str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"))))["id"])
    with acting_as(Principal(key_id="key_admin", name="admin", admin=True)):
        batch = await create_batch(sqlite_store, batch_form(file_id))
    with acting_as(member), pytest.raises(ConflictError) as info:
        await files_service.delete_file(sqlite_store, file_id)
    check_error(info, "file_id", "file_in_use")
    assert str(batch["id"]) not in info.value.message and "another key's batch" in info.value.message


async def test_cancel(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    file_id = str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"))))["id"])
    batch_id = str((await create_batch(sqlite_store, batch_form(file_id)))["id"])
    assert (await batches_service.cancel_batch(sqlite_store, batch_id))["status"] == "cancelling"
    again = await batches_service.cancel_batch(sqlite_store, batch_id)  # unchanged, not an error
    assert again["status"] == "cancelling" and again["cancelling_at"] is not None
    with pytest.raises(NotFoundError) as missing:
        await batches_service.cancel_batch(sqlite_store, "batch_none")
    check_error(missing, "batch_id", "not_found")
    for status in ("completed", "failed", "expired"):
        async with sqlite_store.tx() as conn:
            await conn.execute(sa.update(batches_table).where(batches_table.c.id == batch_id).values(status=status))
        with pytest.raises(ConflictError) as info:
            await batches_service.cancel_batch(sqlite_store, batch_id)
        check_error(info, "batch_id", "batch_not_cancellable")
        assert (await batches_service.retrieve_batch(sqlite_store, batch_id))["status"] == status


async def test_hand_lease(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    file_id = str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"))))["id"])
    batch_id = str((await create_batch(sqlite_store, batch_form(file_id)))["id"])
    answer = await batches_service.hand_lease(sqlite_store, batch_id, "lease-1")
    assert answer["id"] == batch_id and answer["status"] == "validating"
    async with sqlite_store.read() as conn:
        stored = await store_batches.get_batch(conn, batch_id)
    assert stored is not None and stored.caller_lease == "lease-1"
    with pytest.raises(NotFoundError) as missing:
        await batches_service.hand_lease(sqlite_store, "batch_none", "lease-1")
    check_error(missing, "batch_id", "not_found")
    async with sqlite_store.tx() as conn:
        await conn.execute(sa.update(batches_table).where(batches_table.c.id == batch_id).values(status="completed"))
    with pytest.raises(ConflictError) as finished:
        await batches_service.hand_lease(sqlite_store, batch_id, "lease-2")
    check_error(finished, "batch_id", "batch_finished")
    assert "completed" in finished.value.message


async def test_paging_checks(sqlite_store: Store, tmp_path: Path, clock: Clock) -> None:
    for bad in (0, 10_001):
        with pytest.raises(InvalidRequestError) as info:
            await files_service.list_files(sqlite_store, purpose=None, limit=bad, order="desc", after=None)
        check_error(info, "limit")
    with pytest.raises(InvalidRequestError) as order:
        await files_service.list_files(sqlite_store, purpose=None, limit=10, order="newest", after=None)
    check_error(order, "order")
    with pytest.raises(InvalidRequestError) as after:
        await files_service.list_files(sqlite_store, purpose=None, limit=10, order="desc", after="file-none")
    check_error(after, "after")
    for bad in (0, 101):
        with pytest.raises(InvalidRequestError) as info:
            await batches_service.list_batches(sqlite_store, limit=bad, after=None)
        check_error(info, "limit")
    with pytest.raises(InvalidRequestError) as batch_after:
        await batches_service.list_batches(sqlite_store, limit=10, after="batch_none")
    check_error(batch_after, "after")
    ids = [str((await create_file(sqlite_store, upload(spool(tmp_path, b"{}\n"))))["id"]) for _ in range(3)]
    page, more = await files_service.list_files(sqlite_store, purpose="batch", limit=2, order="desc", after=None)
    assert [p["id"] for p in page] == ids[:0:-1] and more
    page, more = await files_service.list_files(sqlite_store, purpose="batch", limit=2, order="desc", after=ids[1])
    assert [p["id"] for p in page] == ids[:1] and not more
