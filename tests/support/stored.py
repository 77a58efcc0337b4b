"""Batches written straight into the store (a file, then its batch in ``validating``), as a server's create would,
for the runner tests that run no HTTP server."""

from __future__ import annotations

from miserver.clock import now
from miserver.ids import ordered_id
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf
from miserver.store.batches import BatchRecord


async def stored_batch(
    store: Store,
    content: bytes,
    *,
    endpoint: str,
    window: int = 86400,
    pack: bool = False,
    owner: str | None = None,
) -> BatchRecord:
    """A ``validating`` batch over the JSON Lines ``content`` for ``endpoint``, expiring ``window`` seconds from now,
    owned by the key ``owner`` (None: no key)."""
    file_id, batch_id = ordered_id("file-"), ordered_id("batch_")
    async with store.tx() as conn:
        await sf.insert_file(
            conn,
            file_id=file_id,
            purpose="batch",
            filename="in.jsonl",
            created_at=now(),
            expires_at=None,
            chunks=[content],
            owner_key_id=owner,
        )
        return await sb.insert_batch(
            conn,
            batch_id=batch_id,
            endpoint=endpoint,
            input_file_id=file_id,
            completion_window="24h",
            created_at=now(),
            expires_at=now() + window,
            metadata=None,
            pack=pack,
            output_expires_seconds=None,
            owner_key_id=owner,
        )
