"""The console honours a key's scopes as the API does: a session acts with its key's scopes, read from the key at
every request, and each page needs the scopes of its API twin. A key with only ``inference`` signs in, but
uploading, creating, cancelling, downloading and the job pages are refused with 403 naming the scope (the API's own
``insufficient_scope`` message), and nothing is stored or changed; a key with ``batches`` and ``files``, and an admin
key, still do all of it. The Socket.IO ``subscribe`` of a session without ``batches`` is refused too.

The console is driven in process (httpx over ASGI) the way a browser does it: the sign-in form with its CSRF cookie,
then the session cookie, every form with the session's CSRF token. The batch runner is stopped, so that a created
job stays ``validating`` (cancellable) on this server without a model.
"""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI

from miserver.app import create_app
from miserver.services.accounts import keys as accounts
from miserver.settings import Settings
from miserver.store import Store
from miserver.store.schema import api_keys
from tests.support.stored import stored_batch

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


@dataclass
class Served:
    """The application, its store, and the keys: ``keys[name] = (key id, key)`` for ``root`` (admin), ``reader``
    (``inference`` only) and ``worker`` (``batches`` and ``files``); ``owned[name] = (file id, batch id)``, a
    ``validating`` job of each key."""

    app: FastAPI
    store: Store
    keys: dict[str, tuple[str, str]]
    owned: dict[str, tuple[str, str]]

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://testserver")

    def bearer(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[name][1]}"}


async def _owned_job(store: Store, owner: str) -> tuple[str, str]:
    """A file and a ``validating`` batch over it, both owned by the key ``owner``: their ids."""
    batch = await stored_batch(store, LINE, endpoint="/v1/chat/completions", window=3600, owner=owner)
    return batch.input_file_id, batch.id


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        app.state.miserver.runner.stop()  # jobs stay validating: cancellable, and nothing else changes them
        store = app.state.miserver.store
        keys: dict[str, tuple[str, str]] = {}
        for name, body in (
            ("root", {"admin": True}),
            ("reader", {"scopes": ["inference"]}),
            ("worker", {"scopes": ["batches", "files"]}),
        ):
            record, key = await accounts.create_key(store, accounts.KeySpec.parse({"name": name, **body}))
            keys[name] = (record.id, key)
        owned = {name: await _owned_job(store, key_id) for name, (key_id, _key) in keys.items()}
        yield Served(app, store, keys, owned)


async def _sign_in(client: httpx.AsyncClient, key: str) -> httpx.Response:
    """Sign in with ``key`` as the sign-in form does (its CSRF token and cookie); the answer is the 303."""
    form = await client.get("/console/signin")
    token = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert token is not None
    answer = await client.post("/console/signin", data={"csrf": token.group(1), "api_key": key, "next": "/console/"})
    assert answer.status_code == 303, answer.text
    return answer


async def _csrf(client: httpx.AsyncClient) -> str:
    """The session's CSRF token, from a page every signed-in key may open (Usage)."""
    page = await client.get("/console/usage")
    assert page.status_code == 200, page.text
    found = re.search(r'data-csrf="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def _refused(answer: httpx.Response, scope: str, api_message: str) -> None:
    """``answer`` is the console's 403 naming ``scope`` with the API's own message (JSON or the error page)."""
    assert answer.status_code == 403, (answer.request.url, answer.status_code, answer.text[:300])
    if answer.headers["content-type"].startswith("application/json"):
        error = answer.json()["error"]
        assert error["code"] == "insufficient_scope" and error["message"] == api_message
    else:
        assert "Error 403" in answer.text and api_message in html.unescape(answer.text)
    assert f"'{scope}'" in api_message


async def _api_message(served: Served, method: str, path: str) -> str:
    """The message of the API's 403 ``insufficient_scope`` for the reader on ``method path``."""
    async with served.client() as api:
        answer = await api.request(method, path, headers=served.bearer("reader"))
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "insufficient_scope"
    message = answer.json()["error"]["message"]
    assert isinstance(message, str)
    return message


async def _counts(store: Store) -> tuple[int, int, dict[str, str]]:
    """How many files and batches are stored, and each batch's status."""
    async with store.tx() as conn:
        files = (await conn.execute(sa.text("SELECT COUNT(*) FROM files"))).scalar_one()
        rows = (await conn.execute(sa.text("SELECT id, status FROM batches"))).all()
    return int(files), len(rows), {str(r[0]): str(r[1]) for r in rows}


async def test_a_key_with_only_inference_is_refused_every_upload_create_cancel_and_download(served: Served) -> None:
    files_message = await _api_message(served, "POST", "/v1/files")
    batches_message = await _api_message(served, "POST", "/v1/batches")
    file_id, batch_id = served.owned["reader"]
    before = await _counts(served.store)
    async with served.client() as client:
        signed = await _sign_in(client, served.keys["reader"][1])
        csrf = await _csrf(client)
        upload = await client.post(
            "/console/upload",
            files={"file": ("in.jsonl", LINE)},
            headers={"X-CSRF-Token": csrf, "Accept": "application/json"},
        )
        _refused(upload, "files", files_message)
        create = await client.post(
            "/console/batches",
            data={"csrf": csrf, "file_id": file_id, "endpoint": "/v1/chat/completions", "window": "24"},
        )
        _refused(create, "batches", batches_message)
        cancel = await client.post(f"/console/batches/{batch_id}/cancel", data={"csrf": csrf, "next": "/console/"})
        _refused(cancel, "batches", batches_message)
        _refused(await client.get(f"/console/files/{file_id}/content"), "files", files_message)
        estimate = await client.get(f"/console/files/{file_id}/estimate", headers={"Accept": "application/json"})
        _refused(estimate, "files", files_message)
        for page in (
            "/console/",
            "/console/batches/new",
            f"/console/batches/{batch_id}",
            f"/console/batches/{batch_id}/row",
        ):
            _refused(await client.get(page), "batches", batches_message)
        assert await _counts(served.store) == before  # nothing stored, nothing cancelled
        # what the key may use still opens, and its navigation offers only that; it lands on its usage
        assert signed.headers["location"] == "/console/usage"
        usage = await client.get("/console/usage")
        assert usage.status_code == 200 and (await client.get("/console/keys")).status_code == 200
        assert 'href="/console/batches/new"' not in usage.text and '<a href="/console/">Jobs' not in usage.text
        assert 'href="/console/keys"' in usage.text


@pytest.mark.parametrize("name", ["worker", "root"])
async def test_a_key_with_batches_and_files_and_an_admin_key_still_do_everything(served: Served, name: str) -> None:
    _file_id, batch_id = served.owned[name]
    async with served.client() as client:
        signed = await _sign_in(client, served.keys[name][1])
        assert signed.headers["location"] == "/console/"
        csrf = await _csrf(client)
        jobs = await client.get("/console/")
        assert jobs.status_code == 200 and batch_id in jobs.text and 'href="/console/batches/new"' in jobs.text
        assert (await client.get("/console/batches/new")).status_code == 200
        upload = await client.post(
            "/console/upload",
            files={"file": ("mine.jsonl", LINE)},
            headers={"X-CSRF-Token": csrf, "Accept": "application/json"},
        )
        assert upload.status_code == 200, upload.text
        uploaded = upload.json()["file"]["id"]
        create = await client.post(
            "/console/batches",
            data={"csrf": csrf, "file_id": uploaded, "endpoint": "/v1/chat/completions", "window": "24"},
        )
        assert create.status_code == 303, create.text
        created = create.headers["location"].rsplit("/", 1)[1]
        detail = await client.get(f"/console/batches/{created}")
        assert detail.status_code == 200 and f'href="/console/files/{uploaded}/content"' in detail.text
        assert (await client.get(f"/console/batches/{created}/row")).status_code == 200
        download = await client.get(f"/console/files/{uploaded}/content")
        assert download.status_code == 200 and download.content == LINE
        cancel = await client.post(f"/console/batches/{created}/cancel", data={"csrf": csrf, "next": "/console/"})
        assert cancel.status_code == 303, cancel.text
    async with served.client() as api:
        answer = await api.get(f"/v1/batches/{created}", headers=served.bearer("root"))
    assert answer.json()["status"] in ("cancelling", "cancelled")


async def test_a_signed_in_session_follows_its_key_at_every_request(served: Served) -> None:
    """The scopes are read from the key at each request, not kept in the session: a key whose scopes change (here
    in the database, as no route changes them) is refused at its next request, with the same cookie."""
    key_id, key = served.keys["worker"]
    async with served.client() as client:
        await _sign_in(client, key)
        assert (await client.get("/console/")).status_code == 200
        async with served.store.tx() as conn:
            await conn.execute(sa.update(api_keys).where(api_keys.c.id == key_id).values(scopes='["files"]'))
        refused = await client.get("/console/")
        assert refused.status_code == 403 and "&#39;batches&#39;" in refused.text
        assert (await client.get(f"/console/files/{served.owned['worker'][0]}/content")).status_code == 200


async def test_a_session_without_batches_cannot_subscribe_to_batch_events(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Socket.IO connection of a console session acts with the session's scopes: ``subscribe`` needs ``batches``
    (the scope of reading the batch over HTTP) and is refused, naming it, without joining the batch's room."""
    events = served.app.state.events
    joined: list[tuple[str, str]] = []

    async def enter_room(sid: str, room: str, namespace: str | None = None) -> None:
        joined.append((sid, room))

    monkeypatch.setattr(events.sio, "enter_room", enter_room)
    callers: dict[str, Any] = {}

    async def principal(sid: str) -> Any:
        return callers[sid]

    monkeypatch.setattr(events, "_principal", principal)
    for name in ("reader", "worker"):
        async with served.client() as client:
            await _sign_in(client, served.keys[name][1])
            cookie = f"miserver_console={client.cookies['miserver_console']}"
        callers[name] = await events.cookie_principal(cookie)
        assert callers[name] is not None and callers[name].key_id == served.keys[name][0]
    assert callers["reader"].scopes == frozenset({"inference"})
    refused = await events._subscribe("reader", {"batch_id": served.owned["reader"][1]})
    assert refused["ok"] is False and "'batches'" in refused["error"]
    assert refused["error"] == await _api_message(served, "GET", f"/v1/batches/{served.owned['reader'][1]}")
    assert await events._subscribe("worker", {"batch_id": served.owned["worker"][1]}) == {"ok": True}
    assert joined == [("worker", f"batch:{served.owned['worker'][1]}")]
