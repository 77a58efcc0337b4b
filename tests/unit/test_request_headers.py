"""The request headers miServer reads (``X-miLLM-Strict``, ``X-miLLM-Lease``): a value it does not understand is 400
``invalid_value`` naming the header, in the route's own envelope, on every route that reads the header; it is never
read as if the header were absent.

The application runs in-process over ASGI with no resident model on SQLite: every refusal here comes before the
route reaches an engine.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miserver.api.openapi import operations
from miserver.app import create_app
from miserver.settings import Settings


@pytest.fixture
async def app_client(tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://miserver") as client:
            yield app, client


def routes_reading(app: Any, header: str) -> list[tuple[str, str]]:
    """``(method, path)`` of every documented route that reads ``header`` (``"strict"``, ``"lease"``), with each path
    parameter filled in."""
    found = []
    for op in operations(app):
        if op.documentation is not None and header in op.documentation.headers:
            path = re.sub(r"\{[^}]+\}", "x_1", op.path)
            found.extend((method, path) for method in sorted(op.methods))
    return found


def assert_refused(answer: httpx.Response, path: str, header: str) -> None:
    """400 ``invalid_value`` naming ``header``: ``param`` in OpenAI's envelope, the message in Anthropic's."""
    assert answer.status_code == 400, (path, answer.status_code, answer.text)
    body = answer.json()
    if path.startswith("/anthropic/"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (path, body)
        assert header in body["error"]["message"], (path, body)
    else:
        error = body["error"]
        assert (error["code"], error["param"]) == ("invalid_value", header), (path, body)
        assert header in error["message"], (path, body)


@pytest.mark.parametrize("value", ["maybe", "on", "2", "truee", "true, false"])
async def test_a_strict_header_it_does_not_understand_is_400_on_every_route(
    app_client: tuple[Any, httpx.AsyncClient], value: str
) -> None:
    app, client = app_client
    routes = routes_reading(app, "strict")
    assert len(routes) >= 10  # chat, completions, embeddings, responses, messages, batches, probes, leases, ...
    for method, path in routes:
        answer = await client.request(method, path, json={}, headers={"X-miLLM-Strict": value})
        assert_refused(answer, path, "X-miLLM-Strict")


@pytest.mark.parametrize(
    ("value", "strict"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("Yes", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("NO", False),
        ("", False),
        (None, False),
    ],
)
async def test_the_strict_spellings_it_accepts(
    app_client: tuple[Any, httpx.AsyncClient], value: str | None, strict: bool
) -> None:
    _, client = app_client
    headers = {} if value is None else {"X-miLLM-Strict": value}
    body = {"holder": "alice", "ttl_seconds": 60, "frobnicate": 1}
    answer = await client.post("/api/lease", json=body, headers=headers)
    if strict:
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "unknown_parameter", answer.text
        assert answer.json()["error"]["param"] == "frobnicate"
    else:
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("value", ["maybe", "lease_", "lease_" + "0" * 23, "LEASE_" + "a" * 24, "x" * 200])
async def test_a_lease_header_that_is_no_lease_token_is_400_on_every_route(
    app_client: tuple[Any, httpx.AsyncClient], value: str
) -> None:
    """Not run as if it were a lease (an inference answer would name it as the lease it ran under, a batch would keep
    it) nor as if it were absent; a long one used to be a 500 on PostgreSQL (the column holds 128 characters)."""
    app, client = app_client
    routes = routes_reading(app, "lease")
    assert len(routes) >= 15  # inference, batches, model load/unload, weights, checkpoints, handing a lease
    for method, path in routes:
        answer = await client.request(method, path, json={}, headers={"X-miLLM-Lease": value})
        assert_refused(answer, path, "X-miLLM-Lease")
        assert value not in answer.text  # a lease token is not echoed


async def test_a_live_lease_and_an_empty_header_are_accepted(app_client: tuple[Any, httpx.AsyncClient]) -> None:
    _, client = app_client
    taken = await client.post("/api/lease", json={"holder": "alice", "ttl_seconds": 60})
    lease = taken.json()["lease"]
    for headers in ({"X-miLLM-Lease": lease}, {"X-miLLM-Lease": ""}, {}):  # the token POST /api/lease handed out
        answer = await client.post("/api/models/unload", headers=headers)
        if headers.get("X-miLLM-Lease"):
            assert answer.json()["error"]["code"] == "model_not_resident", answer.text  # past the lease check
        else:
            assert answer.json()["error"]["code"] == "lease_held", answer.text  # empty: as if absent
