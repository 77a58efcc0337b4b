"""Leases, model residency and waiting reasons (DESIGN §3.5, §4): a batch never loads or swaps a model; it waits,
says why, and runs as soon as its model is resident and it holds the lease."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, wait_for


@pytest.fixture
def server(tiny_model_dir: Path, database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        database_url=database_url,
        data_dir=tmp_path / "var",
        env={"BATCH_CHUNK_ROWS": "2", "BATCH_POLL_SECONDS": "0.2"},
    )
    with proc:
        yield proc


def rows(n: int, max_tokens: int = 12) -> bytes:
    return jsonl(line(f"r{i}", chat_body(f"Tell me about number {i}", max_tokens=max_tokens)) for i in range(n))


def take(http: httpx.Client, holder: str) -> str:
    r = http.post("/api/lease", json={"holder": holder, "ttl_seconds": 300})
    assert r.status_code == 200, r.text
    assert r.json()["holder"] == holder
    return str(r.json()["lease"])


def waiting(client, batch_id: str, reason: str):  # type: ignore[no-untyped-def]
    def check():  # type: ignore[no-untyped-def]
        b = client.batches.retrieve(batch_id)
        return b.status == "in_progress" and b.model_extra["millm"]["waiting_reason"] == reason and b

    return wait_for(check, timeout=180)


def test_lease_routes(server: ServerProcess) -> None:
    http = server.http()
    alice = take(http, "alice")
    assert http.post("/api/lease", json={"holder": "alice", "ttl_seconds": 300}).json()["lease"] == alice  # renew
    refused = http.post("/api/lease", json={"holder": "bob", "ttl_seconds": 300})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "lease_held"
    assert http.post("/api/lease", json={"holder": "bob", "ttl_seconds": 0}).status_code == 400
    assert http.post(f"/api/lease/{alice}/renew", json={"ttl_seconds": 100}).status_code == 200
    assert http.get("/api/health/detailed").json()["lease"]["holder"] == "alice"
    # load and unload need the lease while one is held
    assert http.post("/api/models/unload").json()["error"]["code"] == "lease_held"
    assert http.post(f"/api/lease/{alice}/release").json()["released"] is True
    assert http.post(f"/api/lease/{alice}/renew").status_code == 404
    assert http.get("/api/lease").json()["lease"] is None


def test_validation_fails_while_another_holder_leases_the_model(server: ServerProcess) -> None:
    http = server.http()
    take(http, "alice")
    client = server.client()
    done = wait_terminal(client, submit(client, rows(2)).id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    assert [e.code for e in done.errors.data] == ["lease_unavailable"]


def test_batch_holds_its_own_lease_and_releases_it(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    batch = submit(client, rows(12))
    holder = f"millm-batch:{batch.id}"
    wait_for(
        lambda: (
            http.get("/api/lease").json().get("holder") == holder
            or client.batches.retrieve(batch.id).status == "completed"
        )
    )
    done = wait_terminal(client, batch.id)
    assert done.status == "completed"
    assert http.get("/api/lease").json()["lease"] is None  # released at the end
    assert done.model_extra["millm"]["lease_holder"] is None


def test_caller_lease_waiting_reasons_and_handing_a_lease(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    alice = take(http, "alice")
    batch = submit(client, rows(30), extra_headers={"X-miLLM-Lease": alice})
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress")
    # alice unloads the model under her lease: the batch waits and runs nothing
    assert http.post("/api/models/unload", headers={"X-miLLM-Lease": alice}).status_code == 200
    paused = waiting(client, batch.id, "model_not_resident")
    assert client.batches.retrieve(batch.id).request_counts == paused.request_counts
    catalogue = http.get("/api/models").json()["data"]
    assert any(m["id"] == "tiny" and not m["resident"] for m in catalogue)
    # alice gives up her lease, bob takes it and loads the model: the batch waits for the lease now
    http.post(f"/api/lease/{alice}/release")
    bob = take(http, "bob")
    loaded = http.post("/api/models/load", json={"model": "tiny"}, headers={"X-miLLM-Lease": bob})
    assert loaded.status_code == 200, loaded.text
    waiting(client, batch.id, "lease_unavailable")
    # bob hands his lease to the batch: it runs under it, renews it and never releases it
    handed = http.post(f"/v1/batches/{batch.id}/lease", headers={"X-miLLM-Lease": bob})
    assert handed.status_code == 200, handed.text
    done = wait_terminal(client, batch.id)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 30
    assert http.get("/api/lease").json()["lease"] == bob
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(30)]
    assert out[-1]["response"]["millm"]["headers"]["X-miLLM-Lease"] == bob


def test_weights_torn_flag_holds_the_batch(server: ServerProcess, database_url: str) -> None:
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO model_state (model_id, weights_torn, updated_at) VALUES ('tiny', true, 0)"))
    client = server.client()
    batch = submit(client, rows(3))
    paused = waiting(client, batch.id, "weights_torn")
    assert paused.request_counts is not None and paused.request_counts.completed == 0
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE model_state SET weights_torn = false WHERE model_id = 'tiny'"))
    engine.dispose()
    assert wait_terminal(client, batch.id).status == "completed"
