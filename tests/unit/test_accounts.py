"""Accounts rules without a server (issue 13): keys, prices and costs, the batch verdict (revoked, insufficient
balance with its grace and a top-up during it), token estimates, the exposure check, and the ``keys``/``usage``
commands on a SQLite database."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from click.testing import CliRunner
from fastapi import routing
from starlette.routing import Mount

from miserver.app import create_app
from miserver.cli import main
from miserver.errors import InvalidRequestError
from miserver.protocol.accounts import TopUpRequest
from miserver.protocol.parsing import parse_request
from miserver.services.accounts import keys as accounts
from miserver.services.accounts.balance import BatchVerdict, batch_verdict
from miserver.services.accounts.prices import PriceFileError, PriceTable, cost, price_from_snapshot
from miserver.services.batch_api.estimates import estimate_input_tokens, max_output_tokens
from miserver.services.inference.metering import _stream_usage
from miserver.settings import Settings
from miserver.store import Store
from miserver.store.keys import KeyRecord
from miserver.store.usage import Usage, record_usage


def _key(balance: int | None = 100, revoked_at: int | None = None) -> KeyRecord:
    return KeyRecord("key_1", "k", "sk-abcdefgh", False, balance, None, None, 0, revoked_at)


def test_a_key_is_32_random_bytes_and_only_its_digest_is_kept() -> None:
    key = accounts.new_key()
    assert key.startswith("sk-") and len(base64.urlsafe_b64decode(key[3:] + "=")) == 32
    assert accounts.new_key() != key
    assert accounts.digest(key) == accounts.digest(key) and key not in accounts.digest(key)
    assert len(accounts.digest(key)) == 64


def test_key_spec_names_the_bad_field() -> None:
    assert accounts.KeySpec.parse({"name": "a", "admin": True, "balance": 5}).balance == 5
    for body, param in (
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "a", "admin": "yes"}, "admin"),
        ({"name": "a", "balance": -1}, "balance"),
        ({"name": "a", "balance": 1.5}, "balance"),
        ({"name": "a", "max_pending_batches": True}, "max_pending_batches"),
        ({"name": "a", "colour": "red"}, "colour"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            accounts.KeySpec.parse(body)
        assert caught.value.param == param


def test_key_and_top_up_bodies_parse_with_their_documented_models() -> None:
    """The bodies are parsed with ``protocol/accounts.py``'s models (the ones ``/openapi.json`` shows): an unknown
    field is ``unknown_parameter``, and an amount past 2**53 - 1 is refused with 400 naming it (such a number used to
    reach the database's 64-bit column and fail there)."""
    with pytest.raises(InvalidRequestError) as caught:
        accounts.KeySpec.parse({"name": "a", "colour": "red"})
    assert (caught.value.param, caught.value.code) == ("colour", "unknown_parameter")
    for field in ("balance", "max_pending_batches", "max_enqueued_tokens"):
        assert getattr(accounts.KeySpec.parse({"name": "a", field: 2**53 - 1}), field) == 2**53 - 1
        with pytest.raises(InvalidRequestError) as caught:
            accounts.KeySpec.parse({"name": "a", field: 2**63})
        assert caught.value.param == field
    for body, param, code in (
        ({}, "amount", "missing_required_parameter"),
        ({"amount": 0}, "amount", "invalid_value"),
        ({"amount": "5"}, "amount", "invalid_type"),
        ({"amount": 2**63}, "amount", "invalid_value"),
        ({"amount": 5, "note": "x"}, "note", "unknown_parameter"),
        ([5], None, "invalid_type"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            parse_request(TopUpRequest, body, strict=True)
        assert (caught.value.param, caught.value.code) == (param, code), body


def test_prices_batch_discount_and_costs() -> None:
    table = PriceTable.parse({"batch_discount": 0.5, "models": {"m": {"input": 3, "output": 7}, "*": {"input": 1}}})
    assert table.realtime("m") == (3, 7) and table.realtime("other") == (1, 0)
    assert table.batch("m") == (2, 4)  # round half to even: 1.5 -> 2, 3.5 -> 4
    assert cost((2_000_000, 4_000_000), 10, 5) == 40
    assert cost((1, 0), 499_999, 0) == 0 and cost((1, 0), 500_000, 0) == 1  # half up
    snapshot = PriceTable.parse({"models": {"m": {"input": 2_000_000, "output": 4_000_000}}}).batch_snapshot()
    assert snapshot == {"m": [1_000_000, 2_000_000]}
    assert price_from_snapshot(snapshot, "m") == (1_000_000, 2_000_000)
    assert price_from_snapshot(snapshot, "unknown") == (0, 0) and price_from_snapshot(None, "m") == (
        0,
        0,
    )
    assert not PriceTable().enabled and PriceTable.load(None).realtime("m") == (0, 0)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([], "JSON object"),
        ({"discount": 1}, "unknown field"),
        ({"batch_discount": 2}, "batch_discount"),
        ({"models": {"m": {"input": -1}}}, "micro-units"),
        ({"models": {"m": {"input": 1.5}}}, "micro-units"),
        ({"models": {"m": {"in": 1}}}, "models['m']"),
    ],
)
def test_a_bad_price_file_is_refused_naming_the_field(raw: object, says: str, tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PriceFileError, match=says.replace("[", r"\[")):
        PriceTable.load(path)


def test_batch_verdict_revoked_balance_grace_and_top_up() -> None:
    running = SimpleNamespace(balance_waiting_since=None)
    assert batch_verdict(_key(), running, now=100, grace_seconds=0) == BatchVerdict()
    assert batch_verdict(_key(None), running, now=100, grace_seconds=0) == BatchVerdict()
    revoked = batch_verdict(_key(revoked_at=5), running, now=100, grace_seconds=60)
    assert revoked.fail is not None and revoked.fail.code == "key_revoked"
    assert batch_verdict(None, running, now=100, grace_seconds=60).fail is not None
    empty = batch_verdict(_key(0), running, now=100, grace_seconds=0)
    assert empty.fail is not None and empty.fail.code == "insufficient_quota"
    # with a grace: wait first, fail once the grace has passed since the wait began
    assert batch_verdict(_key(-3), running, now=100, grace_seconds=60).waiting
    waiting = SimpleNamespace(balance_waiting_since=100)
    assert batch_verdict(_key(-3), waiting, now=159, grace_seconds=60).waiting
    assert batch_verdict(_key(-3), waiting, now=160, grace_seconds=60).fail is not None
    # a top-up during the grace: the batch goes on
    assert batch_verdict(_key(50), waiting, now=159, grace_seconds=60) == BatchVerdict()


def test_token_estimates() -> None:
    def tokenize(text: str) -> list[int]:
        return list(range(len(text.split())))

    chat = {
        "messages": [
            {"role": "user", "content": "one two three"},
            {"role": "user", "content": [{"type": "text", "text": "four five"}]},
        ],
        "max_tokens": 4,
        "n": 2,
    }
    assert estimate_input_tokens(tokenize, chat) == 5
    assert estimate_input_tokens(tokenize, {"prompt": [[1, 2, 3], "a b"]}) == 5
    assert max_output_tokens(chat, -1) == 8
    assert max_output_tokens({"messages": []}, -1) == -1
    assert max_output_tokens({"input": "x"}, -1) == 0  # embeddings generate nothing


def test_loopback_addresses() -> None:
    assert all(accounts.is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"))
    assert not any(accounts.is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.org", ""))


def test_keys_and_usage_commands_on_the_database(tmp_path: Path) -> None:
    runner = CliRunner()
    db = ["--data-dir", str(tmp_path)]
    made = runner.invoke(main, ["keys", "create", "--name", "team", "--balance", "5000000", *db])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[0]
    assert key.startswith("sk-")
    listed = runner.invoke(main, ["keys", "list", *db])
    assert listed.exit_code == 0 and "team" in listed.output and key not in listed.output
    key_id = next(w for w in listed.output.split() if w.startswith("key_"))
    assert "5.000000" in listed.output
    topped = runner.invoke(main, ["keys", "top-up", key_id, "1000000", *db])
    assert topped.exit_code == 0 and "6.000000" in topped.output
    assert runner.invoke(main, ["keys", "top-up", key_id, "0", *db]).exit_code == 1
    assert runner.invoke(main, ["keys", "revoke", key_id, *db]).exit_code == 0
    again = runner.invoke(main, ["keys", "revoke", key_id, *db])
    assert again.exit_code == 1 and "already revoked" in again.output
    usage = runner.invoke(main, ["usage", "--group-by", "model", *db])
    assert usage.exit_code == 0 and usage.output.split()[:2] == ["model", "requests"]


def test_usage_and_keys_tables_never_cut_a_value(tmp_path: Path) -> None:
    """The columns widen to the longest value: a model id of 45 characters and a key name of 30 are shown whole."""
    runner = CliRunner()
    db = ["--data-dir", str(tmp_path)]
    name = "nightly-evaluation-suite-team-b"
    made = runner.invoke(main, ["keys", "create", "--name", name, *db])
    assert made.exit_code == 0, made.output
    listed = runner.invoke(main, ["keys", "list", *db])
    assert listed.exit_code == 0 and name in listed.stdout.split(), listed.output
    key_id = next(w for w in listed.output.split() if w.startswith("key_"))

    model = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
    usage = Usage(key_id, model, "realtime", "/v1/chat/completions", 12, 3, 0, int(time.time()), request_id="req_1")

    async def record() -> None:
        store = await Store.open(f"sqlite:///{tmp_path / 'miserver.db'}")
        try:
            async with store.tx() as conn:
                assert await record_usage(conn, usage)
        finally:
            await store.close()

    asyncio.run(record())
    shown = runner.invoke(main, ["usage", "--group-by", "model", *db])
    assert shown.exit_code == 0, shown.output
    header, row = shown.stdout.splitlines()
    assert row.split() == [model, "1", "12", "3", "0.000000"]
    assert header.index("requests") + len("requests") == row.index(" 1 ") + 2  # numbers aligned right under it


async def test_with_a_key_only_the_open_routes_answer_without_one(tmp_path: Path) -> None:
    """Once a key exists, every route of the application is 401 without one, except ``OPEN_ROUTES`` (the health
    probe, ``/openapi.json`` and ``/docs``) and the files ``/docs`` loads, which a browser fetches with no key."""
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await accounts.create_key(app.state.miserver.store, accounts.KeySpec.parse({"name": "a", "admin": True}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://miserver") as client:
            answered: dict[tuple[str, str], int] = {}
            for context in routing.iter_route_contexts(app.routes):
                route = context.original_route
                if isinstance(route, Mount):
                    continue  # the console: its own sign-in (tests/e2e/test_console.py)
                path = getattr(context, "path_format", None) or getattr(route, "path", "")
                for method in sorted(getattr(context, "methods", None) or getattr(route, "methods", None) or ()):
                    if method == "HEAD":
                        continue
                    url = re.sub(r"\{[^}]+\}", "x", path)
                    answered[(method, path)] = (await client.request(method, url)).status_code
            page = await client.get("/docs")
            assets = re.findall(r"(?:src|href)=['\"](/docs/[^'\"]+)['\"]", page.text)
            loaded = {a: (await client.get(a)).status_code for a in assets}
    assert len(answered) >= 40
    opened = {route for route, status in answered.items() if status != 401}
    files = {(m, p) for m, p in answered if m == "GET" and p.startswith("/docs/static/")}
    assert opened == {("GET", "/api/health"), ("GET", "/openapi.json"), ("GET", "/docs"), *files}, opened
    assert opened == {route for route in answered if accounts.is_open(*route)}
    assert {answered[route] for route in opened} == {200}, answered
    assert len(loaded) == 3 and set(loaded.values()) == {200}, loaded  # the Swagger UI script, style and icon


def test_serve_refuses_a_public_address_without_keys(tmp_path: Path) -> None:
    refused = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert refused.exit_code == 1 and "--insecure-no-auth" in refused.output


def test_usage_read_from_stream_events() -> None:
    chat = json.dumps(
        {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    )
    assert _stream_usage(chat) == (9, 4)
    assert _stream_usage(json.dumps({"choices": [{"delta": {"content": "usage"}}]})) is None
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 7, "output_tokens": 3}}}
    assert _stream_usage("event: response.completed\ndata: " + json.dumps(completed)) == (7, 3)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 11, "output_tokens": 1}}}
    assert _stream_usage("event: message_start\ndata: " + json.dumps(start)) == (11, 1)
    assert _stream_usage("data: [DONE]") is None


def test_upstream_health_hides_urls_and_errors_from_a_non_admin_key() -> None:
    entry = {
        "name": "a",
        "live": False,
        "models": ["m"],
        "in_flight": 0,
        "max_in_flight": 2,
        "url": "http://10.0.0.5:8000",
        "last_error": "connect: refused",
    }
    with accounts.acting_as(accounts.Principal("key_1", "team", admin=False)):
        assert accounts.shown_upstreams([entry]) == [{**entry, "url": None, "last_error": None}]
    with accounts.acting_as(accounts.Principal("key_2", "ops", admin=True)):
        assert accounts.shown_upstreams([entry]) == [entry]
