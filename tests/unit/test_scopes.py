"""Key scopes: a key uses only its scopes (403 ``insufficient_scope`` naming the one it lacks); a key made with none,
and every key made before scopes, has the member default (everything but ``models:write`` and ``admin``); what
changes the model for every tenant needs ``models:write``. The table is checked against the application's routes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import routing
from starlette.routing import Mount

from miserver.app import create_app
from miserver.console.access import TWINS, UNLISTED, console_scopes
from miserver.protocol.accounts import MEMBER_DEFAULT_SCOPES
from miserver.services.accounts import keys as accounts
from miserver.services.accounts.scopes import ROUTE_SCOPES, needed_scopes
from miserver.settings import Settings
from miserver.store import keys as store_keys


def app_routes(app: Any) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for context in routing.iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, Mount):
            continue
        path = getattr(context, "path_format", None) or getattr(route, "path", "")
        for method in getattr(context, "methods", None) or getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, path))
    return found


def test_the_table_names_only_routes_that_exist_and_every_model_change_needs_models_write(tmp_path: Path) -> None:
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    routes = app_routes(create_app(settings))
    assert set(ROUTE_SCOPES) <= routes, sorted(set(ROUTE_SCOPES) - routes)
    changes = {
        (m, p)
        for m, p in routes
        if m in ("POST", "DELETE") and p.startswith(("/api/weights", "/api/checkpoints", "/api/lease", "/api/models"))
    }
    changes |= {("POST", "/v1/batches/{batch_id}/lease")}
    assert {route: ROUTE_SCOPES.get(route) for route in changes} == dict.fromkeys(changes, "models:write")
    assert needed_scopes("POST", "/v1/batches", {"x-millm-lease": "lease_0"}) == ("batches", "models:write")
    assert needed_scopes("POST", "/v1/batches", {}) == ("batches",)


def test_every_console_route_names_api_twins_that_exist(tmp_path: Path) -> None:
    """Each console route needs the scopes of its API twins (``console/access.py``): the table names every console
    route and only API routes that exist, so a new page cannot go unchecked and a changed API scope is followed."""
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(settings)
    console = next(r.app for r in app.routes if isinstance(r, Mount) and r.path == "/console")
    assert set(TWINS) == app_routes(console)
    twins = {twin for listed in TWINS.values() for twin in listed}
    assert twins <= app_routes(app), sorted(twins - app_routes(app))
    assert console_scopes("GET", "/") == console_scopes("POST", "/batches/{batch_id}/cancel") == ("batches",)
    assert console_scopes("POST", "/upload") == console_scopes("GET", "/files/{file_id}/content") == ("files",)
    assert console_scopes("GET", "/batches/new") == ("batches", "files")
    assert console_scopes("HEAD", "/usage") == console_scopes("GET", "/keys") == console_scopes("POST", "/signin") == ()
    assert console_scopes("GET", "/not-a-page") == UNLISTED == ("admin",)


@pytest.fixture
async def served(tmp_path: Path) -> Any:
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        store = app.state.miserver.store
        await accounts.create_key(store, accounts.KeySpec.parse({"name": "root", "admin": True}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://miserver") as client:
            yield app, store, client


async def _key(store: Any, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    record, key = await accounts.create_key(store, accounts.KeySpec.parse(body))
    return accounts.key_object(record), key


async def test_each_route_answers_a_key_without_its_scope_with_403_naming_it(served: Any) -> None:
    app, store, client = served
    _shown, member = await _key(store, {"name": "member"})
    _shown, writer = await _key(store, {"name": "writer", "scopes": ["inference", "models:write"]})
    for (method, path), scope in ROUTE_SCOPES.items():
        url = re.sub(r"\{[^}]+\}", "x", path)
        for key, has in ((member, scope in MEMBER_DEFAULT_SCOPES), (writer, scope in ("inference", "models:write"))):
            answer = await client.request(method, url, headers={"Authorization": f"Bearer {key}"})
            error = answer.json().get("error") or {}  # Anthropic's envelope under /anthropic/ has no code
            code = error.get("code", "insufficient_scope" if "scope" in error.get("message", "") else None)
            refused = answer.status_code == 403 and code == "insufficient_scope"
            assert refused == (not has), (method, path, key[:6], answer.status_code, answer.text[:200])
            if refused:
                assert f"'{scope}'" in error["message"]
    leased = await client.post(
        "/v1/batches",
        json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers={"Authorization": f"Bearer {member}", "X-miLLM-Lease": "lease_" + "0" * 24},
    )
    assert leased.status_code == 403 and "'models:write'" in leased.json()["error"]["message"]


async def test_keys_show_their_scopes_and_old_keys_have_the_member_default(served: Any) -> None:
    _app, store, _client = served
    shown, key = await _key(store, {"name": "m"})
    assert shown["scopes"] == ["inference", "batches", "files"]
    async with store.tx() as conn:  # stored as a key made before scopes existed (NULL), read as the member default
        record = await store_keys.get_key(conn, shown["id"])
    assert record is not None and record.scopes is None
    assert (await accounts.principal_for(store, key)).scopes == frozenset(MEMBER_DEFAULT_SCOPES)
    shown, _ = await _key(store, {"name": "w", "scopes": ["models:write", "inference"]})
    assert shown["scopes"] == ["inference", "models:write"] and shown["admin"] is False
    shown, _ = await _key(store, {"name": "a", "scopes": ["admin"]})
    assert shown["admin"] is True and shown["scopes"] == ["inference", "batches", "files", "models:write", "admin"]
    with pytest.raises(Exception, match="scopes"):
        accounts.KeySpec.parse({"name": "x", "scopes": ["everything"]})
    with pytest.raises(Exception, match="scopes"):
        accounts.KeySpec.parse({"name": "x", "scopes": []})
