"""Retention and expiry with an injected clock (no waiting): the application runs in-process, driven over ASGI.

Files expire (content 404 ``file_expired``, record kept), pruning removes expired bytes but never those of a file a
non-terminal batch needs, and a batch still waiting at ``expires_at`` ends ``expired`` with ``batch_expired`` lines.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miserver.app import create_app
from miserver.settings import Settings
from tests.support.inprocess import Clock, installed_clock, set_weights_torn


@pytest.fixture
def clock() -> Iterator[Clock]:
    with installed_clock() as c:
        yield c


@pytest.fixture
async def api(
    tiny_model_dir: Path, database_url: str, tmp_path: Path, clock: Clock
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        database_url=database_url,
        data_dir=tmp_path / "var",
        batch_poll_seconds=0.05,
        file_prune_interval_seconds=3600,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://miserver") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


#: the form fields of an upload that expires an hour after its creation
AN_HOUR = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}


def batch_file(n: int) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
            }
        )
        + "\n"
        for i in range(n)
    ).encode()


async def upload(api: httpx.AsyncClient, data: bytes, **fields: str) -> dict[str, Any]:
    r = await api.post("/v1/files", data={"purpose": "batch", **fields}, files={"file": ("in.jsonl", data)})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def poll(api: httpx.AsyncClient, batch_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    import asyncio

    for _ in range(600):
        b = (await api.get(f"/v1/batches/{batch_id}")).json()
        if done(b):
            return b  # type: ignore[no-any-return]
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} stuck: {b}")


async def test_expired_file_keeps_its_record_and_pruning_spares_files_in_use(
    api: httpx.AsyncClient, clock: Clock, database_url: str
) -> None:
    expiring = await upload(api, batch_file(1), **AN_HOUR)
    assert expiring["expires_at"] == expiring["created_at"] + 3600
    default = await upload(api, batch_file(1))
    assert default["expires_at"] == default["created_at"] + 30 * 86400
    # an input file that a waiting batch still needs
    await set_weights_torn(database_url, True)
    needed = await upload(api, batch_file(2), **AN_HOUR)
    waiting = (
        await api.post(
            "/v1/batches",
            json={"input_file_id": needed["id"], "endpoint": "/v1/chat/completions", "completion_window": "168h"},
        )
    ).json()
    await poll(api, waiting["id"], lambda b: b["millm"]["waiting_reason"] == "weights_torn")

    clock.offset = 3601
    r = await api.get(f"/v1/files/{expiring['id']}/content")
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_expired"
    assert (await api.get(f"/v1/files/{expiring['id']}")).status_code == 200  # the record stays
    assert (await api.get(f"/v1/files/{default['id']}/content")).status_code == 200

    pruned = await api.app.state.miserver.jobs.prune()  # type: ignore[attr-defined]
    assert expiring["id"] in pruned and needed["id"] not in pruned and default["id"] not in pruned

    await set_weights_torn(database_url, False)
    done = await poll(api, waiting["id"], lambda b: b["status"] == "completed")
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    # finished now: its input file may go
    assert needed["id"] in await api.app.state.miserver.jobs.prune()  # type: ignore[attr-defined]


async def test_waiting_batch_expires_with_batch_expired_lines(
    api: httpx.AsyncClient, clock: Clock, database_url: str
) -> None:
    await set_weights_torn(database_url, True)
    f = await upload(api, batch_file(3))
    batch = (
        await api.post(
            "/v1/batches",
            json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"},
        )
    ).json()
    assert batch["expires_at"] == batch["created_at"] + 3600
    await poll(api, batch["id"], lambda b: b["millm"]["waiting_reason"] == "weights_torn")
    clock.offset = 3600
    done = await poll(api, batch["id"], lambda b: b["status"] == "expired")
    assert done["expired_at"] is not None and done["output_file_id"] is None
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    lines = [json.loads(x) for x in (await api.get(f"/v1/files/{done['error_file_id']}/content")).text.splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2"]
    assert all(x["response"] is None and x["error"]["code"] == "batch_expired" for x in lines)
