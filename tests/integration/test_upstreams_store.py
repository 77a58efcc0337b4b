"""Remembered gateway discovery (``store.upstreams``) on SQLite and PostgreSQL: a list replaced whole, what is kept of
odd entries, and two processes writing the same upstream's list at once (the last writer wins, no unique violation).
"""

from __future__ import annotations

import asyncio

from miserver.store import Store
from miserver.store import upstreams as su
from miserver.store.upstreams import StoredModel, StoredUpstream

URL = "http://127.0.0.1:8001/v1"


async def _replace(store: Store, name: str, models: list[tuple[str, int | None]], at: int, url: str = URL) -> None:
    async with store.tx() as conn:
        await su.replace_models(conn, name, url, models, at)


async def _listed(store: Store) -> list[StoredUpstream]:
    async with store.read() as conn:
        return await su.list_upstreams(conn)


async def test_a_list_is_replaced_whole_with_its_url(store: Store) -> None:
    assert await _listed(store) == []
    await _replace(store, "up1", [("m", 4096), ("a", None)], 10)
    await _replace(store, "up2", [], 11, url="http://h:2/v1")  # it answered, listing nothing
    assert await _listed(store) == [
        StoredUpstream("up1", URL, 10, (StoredModel("a", None, 10), StoredModel("m", 4096, 10))),
        StoredUpstream("up2", "http://h:2/v1", 11, ()),
    ]
    await _replace(store, "up1", [("m", 8192), ("n", 64)], 20, url="http://other:1/v1")  # "a" dropped, "n" added
    (up1, up2) = await _listed(store)
    assert up1 == StoredUpstream("up1", "http://other:1/v1", 20, (StoredModel("m", 8192, 20), StoredModel("n", 64, 20)))
    assert up2.models == ()
    await _replace(store, "up1", [], 30)
    assert (await _listed(store))[0] == StoredUpstream("up1", URL, 30, ())


async def test_repeated_long_and_out_of_range_entries(store: Store) -> None:
    long_id = "x" * (su.MAX_MODEL_ID + 1)
    listed = [("m", 10), ("m", 20), (long_id, 5), ("big", 2**40), ("zero", 0), ("y" * su.MAX_MODEL_ID, 7)]
    await _replace(store, "up1", listed, 1)
    (up1,) = await _listed(store)
    assert {m.id: m.context_length for m in up1.models} == {"m": 10, "big": None, "zero": None, "y" * 512: 7}


async def test_a_replace_rolled_back_leaves_the_old_list(store: Store) -> None:
    await _replace(store, "up1", [("m", None)], 1)
    try:
        async with store.tx() as conn:
            await su.replace_models(conn, "up1", URL, [("n", None)], 2)
            raise RuntimeError("stop")
    except RuntimeError:
        pass
    assert await _listed(store) == [StoredUpstream("up1", URL, 1, (StoredModel("m", None, 1),))]


async def test_two_processes_writing_one_upstreams_list_take_turns(database_url: str) -> None:
    """Two stores (two processes' engines) on one database. While the first one's replace of a new upstream is not
    committed, the second one's waits for it (it would otherwise insert the same keys); once the first commits, the
    second's list replaces it. Then many writes of both at once: none fails, and one whole list is left."""
    a, b = await Store.open(database_url), await Store.open(database_url, migrate=False)
    try:
        async with a.tx() as conn:
            await su.replace_models(conn, "up1", URL, [("m", 1), ("n", 1)], 1)
            second = asyncio.create_task(_replace(b, "up1", [("m", 2), ("o", 2)], 2))
            done, _ = await asyncio.wait({second}, timeout=0.5)
            assert not done, "the second writer did not wait for the first one's transaction"
        await second
        assert await _listed(a) == [StoredUpstream("up1", URL, 2, (StoredModel("m", 2, 2), StoredModel("o", 2, 2)))]

        lists = {i: [(f"m{i}", i), ("shared", None)] for i in range(1, 21)}
        await asyncio.gather(*(_replace(a if i % 2 else b, "up1", models, i) for i, models in lists.items()))
        (up1,) = await _listed(b)
        assert len({m.last_seen_at for m in up1.models}) == 1
        at = up1.updated_at
        assert up1.models == tuple(sorted((StoredModel(m, n, at) for m, n in lists[at]), key=lambda m: m.id))
    finally:
        await asyncio.gather(a.close(), b.close())
