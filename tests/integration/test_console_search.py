"""The console's job search (``services/batch_api/job_search.py`` over ``store/batches.py`` ``search_batches``) on
SQLite and
PostgreSQL: by description or id, case-insensitive, LIKE wildcards taken literally, status and owner filters,
pages newest first, and a member never sees another key's jobs."""

from __future__ import annotations

import pytest

from miserver.clock import now
from miserver.errors import InvalidRequestError
from miserver.ids import ordered_id
from miserver.services.accounts import keys as accounts
from miserver.services.batch_api import job_search as console
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import files as sf


async def _batch(store: Store, description: str | None, *, owner: str | None = None, status: str = "validating") -> str:
    file_id, batch_id = ordered_id("file-"), ordered_id("batch_")
    async with store.tx() as conn:
        await sf.insert_file(
            conn,
            file_id=file_id,
            purpose="batch",
            filename="in.jsonl",
            created_at=now(),
            expires_at=None,
            chunks=[b"{}\n"],
            owner_key_id=None,
        )
        await sb.insert_batch(
            conn,
            batch_id=batch_id,
            endpoint="/v1/embeddings",
            input_file_id=file_id,
            completion_window="24h",
            created_at=now(),
            expires_at=now() + 3600,
            metadata={"description": description} if description is not None else None,
            pack=False,
            output_expires_seconds=None,
            owner_key_id=owner,
        )
        if status != "validating":
            await sb.transition(conn, batch_id, ("validating",), status, now())
    return batch_id


async def test_search_by_description_id_status_owner_and_pages(store: Store) -> None:
    nightly = await _batch(store, "Nightly eval — café 100%_done")
    weekly = await _batch(store, "weekly regression", status="failed")
    bare = await _batch(store, None)
    theirs = await _batch(store, "nightly of another team", owner="key_other")

    async def ids(**kw: object) -> list[str]:
        page = await console.search_jobs(store, **{"text": None, "status": None, "key": None, "page": 1, **kw})
        return [j.batch["id"] for j in page.jobs]

    assert await ids() == [theirs, bare, weekly, nightly]  # newest first, an admin sees every owner
    assert await ids(text="NIGHTLY") == [theirs, nightly]
    assert await ids(text="café") == [nightly]  # non-ASCII, matched through the JSON escaping
    assert await ids(text="100%_") == [nightly]  # wildcards are literal
    assert await ids(text="%") == [nightly]
    assert await ids(text=bare[-10:]) == [bare]  # by id
    assert await ids(status="failed") == [weekly]
    assert await ids(key="key_other") == [theirs]
    page = await console.search_jobs(store, text=None, status=None, key=None, page=2, per_page=3)
    assert ([j.batch["id"] for j in page.jobs], page.total, page.pages) == ([nightly], 4, 2)

    member = accounts.Principal(key_id="key_other", name="other", admin=False)
    with accounts.acting_as(member):
        assert await ids() == [theirs]
        assert await ids(key=None, text="nightly") == [theirs]
        with pytest.raises(Exception) as lookup:
            await console.get_job(store, nightly)
        assert getattr(lookup.value, "status_code", None) == 404

    for bad in ({"status": "done"}, {"page": 0}, {"text": "x" * 201}):
        with pytest.raises(InvalidRequestError):
            await ids(**bad)
