"""Accounts end to end (issue 13), with the official SDK presenting ``api_key=``, on SQLite and PostgreSQL: keys and
401/403, tenant isolation of files, batches, events and usage, prices and usage records (realtime and batch at the
batch discount), a balance that runs out mid-batch, queue quotas that refuse and release, a revoked key's batch, and
the ledger after a kill -9 with the batch's prices fixed at its creation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import socketio

from miserver.store import Store
from miserver.store import keys as store_keys
from miserver.store import usage as store_usage
from tests.support.batches import api_error, chat_body, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process, wait_for

# Per-token batch prices are whole micro-units (realtime 2 and 4 per token, batch half of it), so sums are exact.
PRICES = {"currency": "USD", "batch_discount": 0.5, "models": {"tiny": {"input": 2_000_000, "output": 4_000_000}}}
ENV = {"BATCH_POLL_SECONDS": "0.2", "BATCH_CHUNK_ROWS": "2"}


def _rows(n: int, prefix: str = "r", max_tokens: int = 2) -> bytes:
    return jsonl(line(f"{prefix}{i}", chat_body(f"Say {i}", max_tokens=max_tokens)) for i in range(n))


def new_key(http: httpx.Client, admin_key: str, name: str, **spec: Any) -> dict[str, Any]:
    answer = http.post("/api/keys", json={"name": name, **spec}, headers=_auth(admin_key))
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def usage_of(http: httpx.Client, caller: str, **query: str) -> dict[str, Any]:
    answer = http.get("/api/usage", params=query, headers=_auth(caller))
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def total(rollup: dict[str, Any], field: str) -> int:
    return sum(int(item[field]) for item in rollup["data"])


class Accounts:
    """A running server with a price table, its first admin key (made while the server was still open) and an
    httpx client; :meth:`restart` starts it again on the same database and files."""

    def __init__(self, start: Callable[[], ServerProcess], database_url: str, prices: Path) -> None:
        self._start = start
        self.database_url = database_url
        self.prices = prices
        self.server = start().start()
        first = self.server.http().post("/api/keys", json={"name": "root", "admin": True})  # open: no key yet
        assert first.status_code == 200, first.text
        self.admin: str = first.json()["key"]
        self.http = self.server.http()

    def restart(self) -> None:
        self.server.stop()
        self.server = self._start().start()
        self.http = self.server.http()

    def key(self, name: str, **spec: Any) -> tuple[str, str, openai.OpenAI]:
        made = new_key(self.http, self.admin, name, **spec)
        return made["id"], made["key"], self.server.client(api_key=made["key"])


@pytest.fixture(scope="module")
def accounts(
    tiny_model_dir: Path, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Accounts]:
    root = tmp_path_factory.mktemp("accounts")
    prices = root / "prices.json"
    prices.write_text(json.dumps(PRICES))
    env = {**ENV, "MISERVER_PRICES_FILE": str(prices)}
    accounts = Accounts(
        lambda: tiny_server_process(tiny_model_dir, root, database_url=module_database_url, env=env),
        module_database_url,
        prices,
    )
    try:
        yield accounts
    finally:
        accounts.server.stop()


def test_keys_authentication_and_tenant_isolation(accounts: Accounts) -> None:
    http = accounts.http
    # once a key exists every route needs one (401, OpenAI's envelope), but the liveness probe
    assert http.get("/api/health").status_code == 200
    for headers in ({}, _auth("sk-not-a-key")):
        answer = http.get("/v1/files", headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    a_id, a_key, a = accounts.key("team-a")
    b_id, b_key, b = accounts.key("team-b")
    assert http.get("/api/keys", headers=_auth(a_key)).status_code == 403
    assert http.post("/api/models/unload", headers=_auth(a_key)).status_code == 403  # model life is for admins
    listed = http.get("/api/keys", headers=_auth(accounts.admin))
    assert a_key not in listed.text and b_key not in listed.text and all("key" not in k for k in listed.json()["data"])
    assert {a_id, b_id} <= {k["id"] for k in listed.json()["data"]}
    bad = http.post("/api/keys", json={"name": "x", "balance": -5}, headers=_auth(accounts.admin))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "balance"
    # the /anthropic routes take x-api-key too, and refuse in Anthropic's envelope
    message = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert http.post("/anthropic/v1/messages", json=message, headers={"x-api-key": a_key}).status_code == 200
    anonymous_message = http.post("/anthropic/v1/messages", json=message)
    assert anonymous_message.status_code == 401
    assert anonymous_message.json()["error"]["type"] == "authentication_error"
    # a stored Response's input items are its owner's, as the Response is
    answer = http.post(
        "/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 16}, headers=_auth(a_key)
    )
    items = f"/v1/responses/{answer.json()['id']}/input_items"
    assert http.get(items, headers=_auth(a_key)).status_code == 200
    assert http.get(items, headers=_auth(b_key)).status_code == 404

    batch = submit(a, _rows(3))
    file_id = batch.input_file_id
    # B never sees A's objects: 404 (not 403), absent from lists, and A's file is no input for B's batch
    for call, args in (
        (b.files.retrieve, (file_id,)),
        (b.files.content, (file_id,)),
        (b.files.delete, (file_id,)),
        (b.batches.retrieve, (batch.id,)),
        (b.batches.cancel, (batch.id,)),
    ):
        assert api_error(call, *args).status_code == 404
    assert file_id not in {f.id for f in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    refused = api_error(
        b.batches.create, input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert refused.status_code == 400 and error_of(refused)["param"] == "input_file_id"

    # Socket.IO: a client with B's key cannot subscribe to A's batch; A's own client can; no key is refused
    sio_b = socketio.Client(reconnection=False)
    sio_b.connect(accounts.server.base_url, socketio_path="socket.io", auth={"api_key": b_key}, wait_timeout=30)
    heard: list[dict[str, Any]] = []
    sio_b.on("batch:progress", heard.append)
    try:
        assert sio_b.call("subscribe", {"batch_id": batch.id}, timeout=30)["ok"] is False
        sio_a = socketio.Client(reconnection=False)
        sio_a.connect(accounts.server.base_url, socketio_path="socket.io", auth={"api_key": a_key}, wait_timeout=30)
        try:
            assert sio_a.call("subscribe", {"batch_id": batch.id}, timeout=30) == {"ok": True}
        finally:
            sio_a.disconnect()
        anonymous = socketio.Client(reconnection=False)
        with pytest.raises(socketio.exceptions.ConnectionError):
            anonymous.connect(accounts.server.base_url, socketio_path="socket.io", wait_timeout=30)
        done = wait_terminal(a, batch.id)
    finally:
        sio_b.disconnect()
    assert heard == []  # not one event of A's batch reached B
    assert done.status == "completed" and done.output_file_id is not None
    assert len(read_lines(a, done.output_file_id)) == 3
    assert api_error(b.files.content, done.output_file_id).status_code == 404  # the results are A's too
    assert done.usage is not None and done.usage.input_tokens > 0 and done.usage.output_tokens > 0

    # usage: each key reads its own; another key's id answers 404; an admin reads anyone's
    assert usage_of(http, b_key)["data"] == []
    assert http.get("/api/usage", params={"key": a_id}, headers=_auth(b_key)).status_code == 404
    mine = usage_of(http, a_key, kind="batch")
    assert total(mine, "requests") == 3
    assert usage_of(http, accounts.admin, key=a_id, kind="batch")["data"] == mine["data"]

    # taking the model lease changes the model for everyone: a member key lacks models:write (403 naming it)
    refused_scope = http.post("/api/lease", json={"holder": "x", "ttl_seconds": 60}, headers=_auth(a_key))
    assert refused_scope.status_code == 403 and refused_scope.json()["error"]["code"] == "insufficient_scope"
    assert "'models:write'" in refused_scope.json()["error"]["message"]
    writers = {"scopes": ["inference", "batches", "files", "models:write"]}
    _wa_id, wa_key, _wa = accounts.key("deployer-a", **writers)
    _wb_id, wb_key, _wb = accounts.key("deployer-b", **writers)
    # the live lease's token is an admin's to see; its holder names a tenant's object, so another tenant reads a
    # neutral word, in GET /api/lease, the detailed health and a refusal's message alike; an admin sees all
    taken = http.post("/api/lease", json={"holder": "a-deploy-7", "ttl_seconds": 60}, headers=_auth(wa_key)).json()
    try:
        seen = http.get("/api/lease", headers=_auth(b_key)).json()
        assert seen["holder"] == "another holder" and seen["lease"] is None
        health = http.get("/api/health/detailed", headers=_auth(b_key)).json()
        assert health["lease"]["holder"] == "another holder" and "a-deploy-7" not in json.dumps(health)
        assert http.get("/api/lease", headers=_auth(wa_key)).json()["holder"] == "a-deploy-7"
        assert http.get("/api/lease", headers=_auth(accounts.admin)).json()["lease"] == taken["lease"]
        # B taking the lease, even under A's holder name, is refused without A's name or token
        for holder in ("b-job", "a-deploy-7"):
            refused_lease = http.post("/api/lease", json={"holder": holder, "ttl_seconds": 60}, headers=_auth(wb_key))
            assert refused_lease.status_code == 409 and refused_lease.json()["error"]["code"] == "lease_held"
            assert "a-deploy-7" not in refused_lease.text and taken["lease"] not in refused_lease.text
        # the batches' own holder names are theirs alone
        reserved = http.post("/api/lease", json={"holder": "millm-batch:x", "ttl_seconds": 60}, headers=_auth(wb_key))
        assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "holder"
    finally:
        released = http.post(f"/api/lease/{taken['lease']}/release", headers=_auth(accounts.admin))
        assert released.status_code == 200


def test_prices_usage_records_and_batch_usage(accounts: Accounts) -> None:
    http = accounts.http
    key_id, key, client = accounts.key("priced", balance=10_000_000)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    assert chat.usage is not None
    realtime = usage_of(http, key, kind="realtime")
    assert total(realtime, "requests") == 1
    assert total(realtime, "input_tokens") == chat.usage.prompt_tokens
    assert total(realtime, "cost") == 2 * chat.usage.prompt_tokens + 4 * chat.usage.completion_tokens
    # a stream is billed whether or not the client asks to see its usage (stream_options.include_usage)
    for include_usage in (False, True):
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
        reported = [c.usage for c in stream if c.usage is not None]
        assert len(reported) == (1 if include_usage else 0)
    streamed = usage_of(http, key, kind="realtime")
    assert total(streamed, "requests") == 3
    assert total(streamed, "output_tokens") >= chat.usage.completion_tokens + 2  # each stream made >= 1 token

    batch = wait_terminal(client, submit(client, _rows(4, max_tokens=3)).id)
    assert batch.status == "completed" and batch.usage is not None
    rollup = usage_of(http, key, kind="batch", group_by="model")
    assert rollup["data"][0]["model"] == "tiny" and rollup["currency"] == "USD"
    assert total(rollup, "requests") == 4
    assert total(rollup, "input_tokens") == batch.usage.input_tokens
    assert total(rollup, "output_tokens") == batch.usage.output_tokens
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    # the batch pays half the realtime price
    assert total(rollup, "cost") == batch.usage.input_tokens + 2 * batch.usage.output_tokens
    spent = total(usage_of(http, key), "cost")
    assert http.get("/api/account", headers=_auth(key)).json()["balance"] == 10_000_000 - spent

    estimate = http.get(f"/v1/files/{batch.input_file_id}/cost_estimate", headers=_auth(key))
    assert estimate.status_code == 200, estimate.text
    body = estimate.json()
    assert body["rows"] == 4 and body["output_tokens_upper_bound"] == 12 and body["input_tokens"] > 0
    assert body["estimated_cost"] == body["input_tokens"] + 2 * 12 and body["estimated_cost_is_upper_bound"]


@pytest.mark.parametrize(
    ("path", "body", "first_events"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400}, 4),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400}, 3),
        ("/anthropic/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400}, 4),
        ("/v1/responses", {"input": "Hello", "max_output_tokens": 400}, 6),
    ],
)
def test_a_stream_cut_by_its_client_is_charged_for_what_it_made(
    accounts: Accounts, path: str, body: dict[str, Any], first_events: int
) -> None:
    """A client that reads a few events of a long stream and hangs up is charged for the prompt and the tokens made
    until then: its usage record comes although the stream never reached its end (before: nothing was recorded)."""
    http = accounts.http
    _key_id, key, _client = accounts.key(f"cut-{path.rsplit('/', 1)[-1]}", balance=10_000_000)
    events = 0
    request = {"model": "tiny", "stream": True, **body}
    with (
        httpx.Client(base_url=http.base_url, timeout=60) as own,
        own.stream("POST", path, json=request, headers=_auth(key)) as answer,
    ):
        assert answer.status_code == 200
        for line_ in answer.iter_lines():
            if line_.startswith("data:"):
                assert "[DONE]" not in line_ and '"finish_reason": "length"' not in line_
                events += 1
                if events == first_events:
                    break  # hang up in the middle
    assert events == first_events
    wait_for(lambda: total(usage_of(http, key, kind="realtime"), "requests") == 1, timeout=30)
    charged = usage_of(http, key, kind="realtime")
    assert total(charged, "input_tokens") > 0
    assert 0 < total(charged, "output_tokens") < 400
    assert total(charged, "cost") == 2 * total(charged, "input_tokens") + 4 * total(charged, "output_tokens")


def test_balance_runs_out_mid_batch(accounts: Accounts) -> None:
    http = accounts.http
    opening = 40  # micro-units: a few rows of about 15 input tokens + 2 output tokens each
    key_id, key, client = accounts.key("thrifty", balance=opening)
    done = wait_terminal(client, submit(client, _rows(12)).id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    assert done.errors.data[0].code == "insufficient_quota"
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert 0 < len(out) < 12 and len(out) + len(err) == 12
    assert {e["error"]["code"] for e in err} == {"insufficient_quota"} and all(e["response"] is None for e in err)
    assert done.request_counts is not None and done.request_counts.completed == len(out)
    # exactly the completed rows are billed, each once; the last one may overdraw, none after it ran
    rollup = usage_of(http, key)
    assert total(rollup, "requests") == len(out)
    per_row = [x["response"]["body"]["usage"] for x in out]
    charges = [u["prompt_tokens"] + 2 * u["completion_tokens"] for u in per_row]
    assert total(rollup, "cost") == sum(charges)
    balance = http.get("/api/account", headers=_auth(key)).json()["balance"]
    assert balance == opening - sum(charges) and balance <= 0 < balance + charges[-1]
    # no balance: 402 insufficient_quota for a new batch and for a realtime request (nothing created)
    refused = api_error(submit, client, _rows(1))
    assert refused.status_code == 402 and error_of(refused)["code"] == "insufficient_quota"
    chat = api_error(client.chat.completions.create, model="tiny", messages=[{"role": "user", "content": "x"}])
    assert chat.status_code == 402
    topped = http.post(f"/api/keys/{key_id}/top_up", json={"amount": 1000}, headers=_auth(accounts.admin))
    assert topped.status_code == 200 and topped.json()["balance"] == balance + 1000
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_queue_quotas_refuse_and_release(accounts: Accounts) -> None:
    _, _, client = accounts.key("queued", max_pending_batches=1)
    first = submit(client, _rows(40, max_tokens=8))
    refused = api_error(submit, client, _rows(1))
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "pending_batch_limit_exceeded" and "its limit is 1" in error["message"]
    client.batches.cancel(first.id)
    assert wait_terminal(client, first.id).status == "cancelled"
    second = wait_terminal(client, submit(client, _rows(1)).id)  # the reservation was released
    assert second.status == "completed"

    _, _, small = accounts.key("few-tokens", max_enqueued_tokens=1)
    failed = wait_terminal(small, submit(small, _rows(1)).id)
    assert failed.status == "failed"
    assert failed.errors is not None and failed.errors.data is not None
    assert failed.errors.data[0].code == "token_limit_exceeded"


def test_revoked_key_stops_its_batch(accounts: Accounts) -> None:
    http = accounts.http
    key_id, key, client = accounts.key("leaving")
    batch = submit(client, _rows(200, max_tokens=8))
    wait_for(lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.completed >= 2)
    revoked = http.post(f"/api/keys/{key_id}/revoke", headers=_auth(accounts.admin))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert http.get("/v1/files", headers=_auth(key)).status_code == 401
    admin = accounts.server.client(api_key=accounts.admin)
    done = wait_terminal(admin, batch.id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None and done.errors.data[0].code == "key_revoked"
    out, err = read_lines(admin, done.output_file_id), read_lines(admin, done.error_file_id)
    assert len(out) >= 2 and len(out) + len(err) == 200
    assert {e["error"]["code"] for e in err} == {"key_revoked"}
    assert total(usage_of(http, accounts.admin, key=key_id), "requests") == len(out)  # completed rows are billed


def test_a_key_retries_its_own_batch_and_owns_the_retry(accounts: Accounts) -> None:
    """A member key's retry: the new batch and its input file belong to the key (no other key sees them)."""
    http = accounts.http
    _, key, client = accounts.key("retrier")
    _, other_key, _ = accounts.key("neighbour")
    batch = submit(client, _rows(100, max_tokens=8))
    client.batches.cancel(batch.id)
    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled" and done.request_counts is not None
    answer = http.post(f"/v1/batches/{done.id}/retry", headers=_auth(key))
    assert answer.status_code == 200, answer.text
    retry = client.batches.retrieve(answer.json()["id"])
    assert retry.metadata == {"retry_of": done.id}
    retried = [r["custom_id"] for r in read_lines(client, retry.input_file_id)]
    assert len(retried) == 100 - done.request_counts.completed and retried[-1] == "r99"
    assert http.get(f"/v1/batches/{retry.id}", headers=_auth(other_key)).status_code == 404
    assert http.get(f"/v1/files/{retry.input_file_id}", headers=_auth(other_key)).status_code == 404
    assert http.post(f"/v1/batches/{retry.id}/cancel", headers=_auth(other_key)).status_code == 404
    client.batches.cancel(retry.id)  # the key cancels its own retry (its rows need not run for this test)
    assert wait_terminal(client, retry.id).status == "cancelled"


def test_ledger_after_kill9_and_prices_fixed_at_creation(accounts: Accounts) -> None:
    """Kill -9 mid-batch, restart with doubled prices: every recorded row is charged exactly once at the batch's
    creation prices, a realtime request after the restart pays the new price, and the ledger recomputes. (Last test of
    the module: it restarts the module's server.)"""
    rows, opening = 30, 10_000_000
    key_id, key, client = accounts.key("ledger", balance=opening)
    batch = submit(client, _rows(rows, max_tokens=4))
    wait_for(lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.completed >= 8)
    accounts.server.kill9()
    accounts.prices.write_text(json.dumps({**PRICES, "models": {"tiny": {"input": 4_000_000, "output": 8_000_000}}}))
    accounts.restart()
    client = accounts.server.client(api_key=key)
    done = wait_terminal(client, batch.id, timeout=300)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    http = accounts.server.http()
    batch_use = usage_of(http, key, kind="batch")
    realtime = usage_of(http, key, kind="realtime")
    balance = http.get("/api/account", headers=_auth(key)).json()["balance"]
    assert done.status == "completed" and done.usage is not None
    assert total(batch_use, "requests") == rows
    assert total(batch_use, "cost") == done.usage.input_tokens + 2 * done.usage.output_tokens  # creation prices
    assert chat.usage is not None
    assert total(realtime, "cost") == 4 * chat.usage.prompt_tokens + 8 * chat.usage.completion_tokens  # new prices
    assert balance == opening - total(batch_use, "cost") - total(realtime, "cost")

    async def audit() -> tuple[store_keys.Ledger, tuple[int, int]]:
        store = await Store.open(accounts.database_url)
        try:
            async with store.read() as conn:
                return await store_keys.ledger(conn, key_id), await store_usage.batch_charges(conn, batch.id)
        finally:
            await store.close()

    ledger, (records, cost) = asyncio.run(audit())
    assert ledger.consistent and ledger.credits == opening and ledger.records == rows + 1
    assert records == rows and cost == total(batch_use, "cost")  # no double charge, no lost charge
