"""Running batches for real (issue 14), end to end on a spawned server with the tiny model (SQLite): fair share
between a large and a small batch, results while running, pause and resume, retry and delete, webhooks received by
a real HTTP server and verified with the ``standardwebhooks`` library (also across a kill -9), the ETA, and
``/metrics`` read with the Prometheus text parser. The store-level rules run on both databases in
``tests/integration/test_operations_store.py``."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from standardwebhooks.webhooks import Webhook

from miserver.cli import main
from tests.support.batches import api_error, chat_body, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.receiver import Receiver
from tests.support.server import ServerProcess, tiny_server_process, wait_for

ENV = {
    "MISERVER_WEBHOOK_ALLOW_PRIVATE": "1",
    "MISERVER_WEBHOOK_RETRY_SECONDS": "0.5",
    "BATCH_CHUNK_ROWS": "4",
    "BATCH_POLL_SECONDS": "0.2",
}
#: An input longer than the tiny model's 512-token context: validation does not tokenize, so it fails when run.
TOO_LONG = "tell me more about this " * 200
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def server_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("operations")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, server_root: Path) -> Iterator[ServerProcess]:
    """One server for the module; the last test kills it with SIGKILL and starts another on its database."""
    with tiny_server_process(tiny_model_dir, server_root, env=ENV) as started:
        yield started


def chat_lines(prefix: str, count: int, *, max_tokens: int = 3) -> bytes:
    return jsonl(line(f"{prefix}-{i}", chat_body(f"{prefix} row {i}", max_tokens=max_tokens)) for i in range(count))


def embed(custom_id: str, text: str) -> dict[str, Any]:
    return line(custom_id, {"model": "tiny", "input": text}, url=EMBEDDINGS)


def embed_lines(prefix: str, count: int) -> bytes:
    return jsonl(embed(f"{prefix}-{i}", f"{prefix} row {i} " * 8) for i in range(count))


def results(server: ServerProcess, batch_id: str, **params: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    answer = server.http().get(f"/v1/batches/{batch_id}/results", params=params)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/jsonl")
    return [json.loads(x) for x in answer.text.splitlines()], dict(answer.headers)


def test_a_small_batch_created_with_a_large_one_finishes_first(server: ServerProcess) -> None:
    client = server.client()
    big = submit(client, chat_lines("big", 300, max_tokens=1))
    small = submit(client, chat_lines("small", 10, max_tokens=1))
    done = wait_terminal(client, small.id)
    assert (done.status, done.request_counts.completed) == ("completed", 10)  # type: ignore[union-attr]
    running = client.batches.retrieve(big.id)
    assert running.status in ("validating", "in_progress"), "the small batch must not wait for the large one"
    assert running.request_counts.completed < 300  # type: ignore[union-attr]

    # the large one carries an ETA once its rate is measured; then it is cancelled (its rows are not the point)
    def estimated() -> dict[str, Any] | None:
        millm: dict[str, Any] = client.batches.retrieve(big.id).model_extra["millm"]  # type: ignore[index]
        return millm if millm["estimated_completion_at"] is not None else None

    millm = wait_for(estimated, timeout=60)
    assert millm["priority"] == 0 and millm["paused"] is False
    assert millm["estimated_completion_at"] >= running.created_at
    client.batches.cancel(big.id)
    final = wait_terminal(client, big.id)
    assert final.status == "cancelled"
    assert final.model_extra["millm"]["estimated_completion_at"] is None  # type: ignore[index]


def test_pause_results_while_running_and_resume(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    batch = submit(client, embed_lines("p", 40), endpoint=EMBEDDINGS)
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 6)  # type: ignore[union-attr]
    paused = http.post(f"/v1/batches/{batch.id}/pause").json()
    assert paused["millm"]["paused"] is True and paused["status"] == "in_progress"
    assert paused["millm"]["waiting_reason"] == "paused"
    at_pause = paused["request_counts"]["completed"]
    lines, headers = results(server, batch.id, limit=3)
    assert headers["x-incomplete"] == "true"
    assert [x["custom_id"] for x in lines] == ["p-0", "p-1", "p-2"] and headers["x-last-line"] == "3"
    rest, headers = results(server, batch.id, offset=3, limit=1000)
    recorded = 3 + len(rest)
    assert [x["custom_id"] for x in rest] == [f"p-{i}" for i in range(3, recorded)], "input order, no gap"
    assert int(headers["x-last-line"]) == recorded
    # dispatch stops at the next row boundary: at most the row running at the pause is recorded after it
    later = client.batches.retrieve(batch.id).request_counts.completed  # type: ignore[union-attr]
    assert recorded <= later <= at_pause + 1 < 40
    assert http.post(f"/v1/batches/{batch.id}/pause").json()["millm"]["paused"] is True  # unchanged
    resumed = http.post(f"/v1/batches/{batch.id}/resume").json()
    assert resumed["millm"]["paused"] is False
    done = wait_terminal(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 40  # type: ignore[union-attr]
    every, headers = results(server, batch.id, limit=1000)
    assert headers["x-incomplete"] == "false" and len(every) == 40
    one, _ = results(server, batch.id, custom_id="p-7")
    assert [x["custom_id"] for x in one] == ["p-7"]
    none, _ = results(server, batch.id, status="failed")
    assert none == []
    bad = http.get(f"/v1/batches/{batch.id}/results", params={"status": "done"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"
    ended = http.post(f"/v1/batches/{batch.id}/pause")
    assert ended.status_code == 409 and ended.json()["error"]["code"] == "batch_not_active"


def test_retry_takes_only_the_failed_rows_and_delete_removes_the_batch(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    data = jsonl([embed("ok-1", "fine"), embed("bad-1", TOO_LONG), embed("ok-2", "fine too"), embed("bad-2", TOO_LONG)])
    first = wait_terminal(client, submit(client, data, endpoint=EMBEDDINGS, metadata={"team": "a"}).id)
    assert (first.request_counts.completed, first.request_counts.failed) == (2, 2)  # type: ignore[union-attr]
    failed, _ = results(server, first.id, status="failed")
    assert [x["custom_id"] for x in failed] == ["bad-1", "bad-2"]
    refused = http.post(f"/v1/batches/{first.id}/retry")
    retry = refused.json()
    assert refused.status_code == 200, retry
    assert retry["metadata"] == {"team": "a", "retry_of": first.id}
    assert retry["endpoint"] == first.endpoint and retry["id"] != first.id
    second = wait_terminal(client, retry["id"])
    assert second.request_counts.total == 2  # type: ignore[union-attr]
    lines = read_lines(client, second.error_file_id)
    assert [x["custom_id"] for x in lines] == ["bad-1", "bad-2"], "only the failed rows ran again"
    assert error_of(api_error(client.batches.cancel, second.id))["code"] == "batch_not_cancellable"
    # delete: its rows go, its files stay
    running = submit(client, embed_lines("d", 4), endpoint=EMBEDDINGS)
    assert http.delete(f"/v1/batches/{running.id}").status_code in (409, 200)  # 409 unless it already ended
    wait_terminal(client, running.id)
    deleted = http.delete(f"/v1/batches/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "batch", "deleted": True}
    assert error_of(api_error(client.batches.retrieve, first.id))["code"] == "not_found"
    assert client.files.content(first.output_file_id).text  # type: ignore[arg-type]
    assert http.post(f"/v1/batches/{first.id}/retry").status_code == 404


def test_webhooks_signed_in_openai_event_shape(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    with Receiver() as receiver:
        created = http.post("/api/webhooks", json={"url": receiver.url, "events": ["batch.completed"]})
        assert created.status_code == 200, created.text
        endpoint = created.json()
        assert endpoint["secret"].startswith("whsec_") and endpoint["events"] == ["batch.completed"]
        listed = http.get("/api/webhooks").json()["data"]
        assert [w["id"] for w in listed] == [endpoint["id"]] and "secret" not in listed[0]
        batch = wait_terminal(client, submit(client, embed_lines("w", 3), endpoint=EMBEDDINGS).id)
        got = wait_for(receiver.delivered, timeout=30)
        assert len(got) == 1
        payload = Webhook(endpoint["secret"]).verify(got[0].body, got[0].headers)
        assert payload["type"] == "batch.completed" and payload["object"] == "event"
        assert payload["data"] == {"id": batch.id} and payload["id"].startswith("evt_")
        assert isinstance(payload["created_at"], int)
        with pytest.raises(Exception, match="[Ss]ignature"):
            Webhook(endpoint["secret"]).verify(got[0].body.replace(b"completed", b"failed"), got[0].headers)
        bad = http.post("/api/webhooks", json={"url": receiver.url, "events": ["batch.done"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "events[0]"
        assert http.delete(f"/api/webhooks/{endpoint['id']}").json()["deleted"] is True


def test_metrics_parse_with_the_expected_series(server: ServerProcess) -> None:
    client = server.client()
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = server.http().get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "miserver_batches",
        "miserver_batch_rows",
        "miserver_batch_backlog_rows",
        "miserver_batch_rows_per_second",
        "miserver_batch_tokens_per_second",
        "miserver_admission_queue_depth",
        "miserver_interactive_request_seconds",
        "miserver_engine_busy_fraction",
        "miserver_webhook_events",
        "miserver_webhook_delivery_attempts",
    ):
        assert name in families, name
    statuses = {s.labels["status"]: s.value for s in families["miserver_batches"].samples}
    assert statuses["completed"] >= 1
    latency = [s for s in families["miserver_interactive_request_seconds"].samples if s.name.endswith("_count")]
    assert any(s.labels["route"] == "/v1/chat/completions" and s.value >= 1 for s in latency)
    rates = families["miserver_batch_rows_per_second"].samples
    assert any(s.labels["endpoint"] == EMBEDDINGS and s.labels["model"] == "tiny" and s.value > 0 for s in rates)
    priorities = {s.labels["priority"] for s in families["miserver_admission_queue_depth"].samples}
    assert priorities == {"interactive", "batch"}


def test_priority_field_is_checked(server: ServerProcess) -> None:
    client = server.client()
    uploaded = client.files.create(file=("in.jsonl", chat_lines("x", 1)), purpose="batch")
    exc = api_error(
        client.batches.create,
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"priority": "high"},
    )
    assert isinstance(exc, openai.BadRequestError) and error_of(exc)["param"] == "priority"
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"priority": 7, "millm_allow_late": True},
    )
    assert created.model_extra["millm"]["priority"] == 7  # type: ignore[index]
    wait_terminal(client, created.id)


def test_cli_list_watch_pause_resume_cancel_retry_download(server: ServerProcess, tmp_path: Path) -> None:
    client = server.client()
    url = ["--url", server.base_url]

    def cli(*args: str) -> str:
        result = CliRunner().invoke(main, ["batch", *args, *url])
        assert result.exit_code == 0, result.output
        return result.output

    # enough rows that the batch is still running when the next command arrives (pause, then cancel, of a batch
    # that has already completed is a 409, rightly)
    fine = [f"c-{i}" for i in range(1, 61) if i != 2]
    data = jsonl([embed("c-2", TOO_LONG), *(embed(c, f"fine {c} " * 20) for c in fine)])
    batch = submit(client, data, endpoint=EMBEDDINGS)
    paused = cli("pause", batch.id)
    assert paused.startswith(f"{batch.id}: ") and paused.strip().endswith(", paused")
    assert cli("resume", batch.id).strip().endswith(", resumed")
    assert "59 completed, 1 failed of 60" in cli("watch", batch.id)
    assert batch.id in cli("list", "--limit", "5")
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    cli("download", batch.id, "-o", str(out), "-e", str(err))
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(fine)
    assert [json.loads(x)["custom_id"] for x in err.read_text().splitlines()] == ["c-2"]
    retried = cli("retry", batch.id).strip()
    assert retried.startswith("batch_") and retried != batch.id
    assert [r["custom_id"] for r in read_lines(client, client.batches.retrieve(retried).input_file_id)] == ["c-2"]
    wait_terminal(client, retried)
    large = submit(client, chat_lines("cancel", 200))
    cancelled = cli("cancel", large.id)
    assert cancelled.startswith(f"{large.id}: ") and ("cancelling" in cancelled or "cancelled" in cancelled)
    assert wait_terminal(client, large.id).status == "cancelled"
    refused = CliRunner().invoke(main, ["batch", "pause", batch.id, *url])
    assert refused.exit_code == 1 and "409 batch_not_active" in refused.output


def test_an_endpoint_that_does_not_answer_holds_back_only_its_own_events(server: ServerProcess) -> None:
    """Endpoint X (registered first, so first in the outbox) holds every request open; endpoint Y still gets its
    event while X's attempt is in flight: none of X's attempts has failed yet when Y's arrives, where one queue
    would have waited out X's attempt (10 s) first."""
    client = server.client()
    http = server.http()
    release = threading.Event()
    with Receiver(hold=release) as x, Receiver() as y:
        ids = [
            http.post("/api/webhooks", json={"url": r.url, "events": ["batch.completed"]}).json()["id"] for r in (x, y)
        ]
        try:
            failed_before = _failed_attempts(http)
            wait_terminal(client, submit(client, embed_lines("iso", 2), endpoint=EMBEDDINGS).id)
            wait_for(lambda: x.waiting == 1, timeout=30)  # X's attempt is open
            got = wait_for(y.delivered, timeout=30)
            assert len(got) == 1 and x.waiting == 1
            assert _failed_attempts(http) == failed_before, "Y's event waited for X's attempt to fail"
        finally:
            release.set()
            for endpoint_id in ids:
                http.delete(f"/api/webhooks/{endpoint_id}")


def _failed_attempts(http: httpx.Client) -> float:
    m = re.search(
        r'^miserver_webhook_delivery_attempts_total\{result="failed"\} (\S+)', http.get("/metrics").text, re.M
    )
    assert m, "no failed-attempts counter on /metrics"
    return float(m.group(1))


def test_a_webhook_survives_kill_9_between_status_change_and_delivery(
    server: ServerProcess, tiny_model_dir: Path, server_root: Path
) -> None:
    """The receiver refuses while the batch completes (the event waits in the outbox), the server is killed, the
    receiver comes back: the restarted server delivers the event once, under the same webhook-id. (Last in the
    module: it kills the module's server.)"""
    with Receiver(status=503) as receiver:
        try:
            http = server.http()
            secret = http.post("/api/webhooks", json={"url": receiver.url, "events": ["batch.completed"]}).json()
            client = server.client()
            batch = wait_terminal(client, submit(client, embed_lines("k", 2), endpoint=EMBEDDINGS).id)
            wait_for(receiver.all, timeout=30)  # a first attempt was refused
        finally:
            server.kill9()
        receiver.status = 200
        with tiny_server_process(tiny_model_dir, server_root, env=ENV) as second:
            got = wait_for(receiver.delivered, timeout=60)
            assert len(got) == 1
            attempts = receiver.all()
            assert {a.headers["webhook-id"] for a in attempts} == {got[0].headers["webhook-id"]}
            payload = Webhook(secret["secret"]).verify(got[0].body, got[0].headers)
            assert payload["data"]["id"] == batch.id
            text = second.http().get("/metrics").text
            assert 'miserver_webhook_events{state="pending"} 0.0' in text
