"""The model-life facts of the store on SQLite and PostgreSQL: the torn flag, checkpoint records (a delete refused
while a batch that has not ended names the checkpoint, in one guarded statement), catalogue entries, the batch pin."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError

from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf
from miserver.store import model_life as sm
from miserver.store.model_life import CatalogueRecord, CheckpointRecord

CK = CheckpointRecord(
    model_id="org/ck:1", path="/x", base_model="tiny", weights_revision="sha256:ab", bytes=7, created_at=5
)


async def test_torn_flag_upsert(store: Store) -> None:
    async with store.tx() as conn:
        assert not await sm.weights_torn(conn, "tiny")
        await sm.set_weights_torn(conn, "tiny", True, 1)
        assert await sm.weights_torn(conn, "tiny")
        await sm.set_weights_torn(conn, "tiny", False, 2)
        assert not await sm.weights_torn(conn, "tiny")


async def test_checkpoint_records_and_the_delete_guard(store: Store) -> None:
    async with store.tx() as conn:
        await sm.insert_checkpoint(conn, CK)
        assert await sm.list_checkpoints(conn) == [CK]
        assert await sm.get_checkpoint(conn, CK.model_id) == CK
        await sf.insert_file(
            conn,
            file_id="file-1",
            purpose="batch",
            filename="in.jsonl",
            created_at=1,
            expires_at=None,
            chunks=[b"x"],
            owner_key_id=None,
        )
        await sb.insert_batch(
            conn,
            batch_id="batch_1",
            endpoint="/v1/completions",
            input_file_id="file-1",
            completion_window="24h",
            created_at=1,
            expires_at=86401,
            metadata=None,
            pack=False,
            output_expires_seconds=None,
            weights_revision="sha256:ab",
        )
        await sb.set_fields(conn, "batch_1", ("validating",), model=CK.model_id)
        assert (await sb.get_batch(conn, "batch_1")).weights_revision == "sha256:ab"  # type: ignore[union-attr]
    async with store.tx() as conn:
        assert not await sm.delete_checkpoint(conn, CK.model_id)  # a live batch names it
        assert await sm.batches_naming(conn, CK.model_id) == ["batch_1"]
        await sb.transition(conn, "batch_1", ("validating",), "failed", 2)
    async with store.tx() as conn:
        assert await sm.delete_checkpoint(conn, CK.model_id)
        assert await sm.list_checkpoints(conn) == []
    with pytest.raises(IntegrityError):
        async with store.tx() as conn:
            await sm.insert_checkpoint(conn, CK)
            await sm.insert_checkpoint(conn, CK)


async def test_catalogue_entries_replace_by_id(store: Store) -> None:
    async with store.tx() as conn:
        await sm.add_catalogue_model(conn, CatalogueRecord("m", "/a", ("A",), 1))
        await sm.add_catalogue_model(conn, CatalogueRecord("m", "/b", ("B", "c"), 2))
        assert await sm.list_catalogue_models(conn) == [CatalogueRecord("m", "/b", ("B", "c"), 2)]
