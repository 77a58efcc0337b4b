"""The input file of a batch that has not finished is never deleted, even when the delete and the batch's create
race, on SQLite and PostgreSQL.

A Message Batch delete also deletes the input file its create wrote, unless a batch that has not finished reads it:
a ``/v1/batches`` create may name that file (it is an ordinary ``batch`` file of the caller's). The create locks the
file's record before it inserts the batch; the delete must lock it before it asks whether a batch reads the file, or
a create that commits between the question and the delete leaves a batch whose input is gone (its validation would
fail the batch with ``file_not_found``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from miserver.errors import ConflictError, InvalidRequestError
from miserver.services.batch_api import batches as batches_service
from miserver.services.batch_api import files as files_service
from miserver.services.batch_api import message_batches
from miserver.store import Store
from miserver.store import batches as store_batches
from miserver.store import files as store_files

REQUEST = {"custom_id": "a", "params": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}
#: How long the delete waits for the racing create before it goes on (a create that is not blocked takes far less).
RACE_WAIT_SECONDS = 2.0


async def test_a_create_racing_a_message_batch_delete_never_loses_its_input_file(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = await message_batches.create(
        store,
        json.dumps({"requests": [REQUEST]}).encode(),
        base_url="http://miserver/",
        max_window_hours=168,
        pack_default=False,
        file_expiry_seconds=86_400,
    )
    batch_id = made["id"].replace("msgbatch_", "batch_")
    async with store.tx() as conn:
        input_file_id = (await store_batches.get_batch(conn, batch_id)).input_file_id  # type: ignore[union-attr]
        await store_batches.transition(conn, batch_id, ("validating",), "failed", 1)  # ended: it may be deleted

    create = {"input_file_id": input_file_id, "endpoint": "/anthropic/v1/messages", "completion_window": "24h"}
    racing: list[asyncio.Task[dict[str, Any]]] = []
    asked = store_files.referencing_active_batch

    async def asked_then_raced(conn: Any, file_id: str) -> Any:
        """The delete's question, then a create over the same file, which the delete gives time to commit."""
        answer = await asked(conn, file_id)
        if file_id == input_file_id and not racing:
            form = batches_service.BatchCreate(raw=json.dumps(create).encode())
            task = asyncio.create_task(
                batches_service.create_batch(store, form, max_window_hours=168, pack_default=False)
            )
            racing.append(task)
            await asyncio.wait({task}, timeout=RACE_WAIT_SECONDS)
        return answer

    monkeypatch.setattr(store_files, "referencing_active_batch", asked_then_raced)
    await message_batches.delete(store, made["id"])
    assert racing, "the delete asked no question about the input file"
    try:
        created = await asyncio.wait_for(racing[0], timeout=30)
    except InvalidRequestError as refused:  # the delete came first: the create found no file
        assert refused.param == "input_file_id"
        async with store.tx() as conn:
            assert await store_files.get_file(conn, input_file_id) is None
        return
    async with store.tx() as conn:  # the create came first: the file stays while its batch has not finished
        assert await store_files.get_file(conn, input_file_id) is not None, (
            f"the input file of {created['id']} (status {created['status']}) was deleted"
        )


async def test_a_file_delete_racing_a_batch_create_over_it_never_leaves_the_batch_without_its_input(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}
    async with store.tx() as conn:
        record = await store_files.insert_file(
            conn,
            file_id="file-race",
            purpose="batch",
            filename="in.jsonl",
            created_at=1,
            expires_at=None,
            chunks=[json.dumps(line).encode() + b"\n"],
            owner_key_id=None,
        )
    create = {"input_file_id": record.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    racing: list[asyncio.Task[dict[str, Any]]] = []
    read = store_files.get_file

    async def read_then_raced(conn: Any, file_id: str, *, lock: bool = False) -> Any:
        """The create's read of its input file, then a delete of that file, which the create gives time to end."""
        answer = await read(conn, file_id, lock=lock)
        if lock and not racing:
            task = asyncio.create_task(files_service.delete_file(store, file_id))
            racing.append(task)
            await asyncio.wait({task}, timeout=RACE_WAIT_SECONDS)
        return answer

    monkeypatch.setattr(store_files, "get_file", read_then_raced)
    form = batches_service.BatchCreate(raw=json.dumps(create).encode())
    created = await batches_service.create_batch(store, form, max_window_hours=168, pack_default=False)
    assert racing
    try:
        await asyncio.wait_for(racing[0], timeout=30)
    except ConflictError as refused:  # the create came first: its batch reads the file
        assert refused.code == "file_in_use"
    async with store.tx() as conn:
        assert await read(conn, record.id) is not None, f"the input file of {created['id']} was deleted"
