"""A gateway remembers what its upstreams serve (``store.upstreams``): restarted while an upstream is down, it still
knows that upstream's models, so a synchronous request naming one gets 503 ``upstream_unavailable`` (not 404
``model_not_found``) and a batch waits (``upstream_unavailable``) until the upstream is back, then completes. An
upstream that never answered leaves a 404 that says its models are not known yet.

The upstream is a real HTTP server process (``tests.support.fake_upstream``), stopped and started again on the same
port; the gateway is a ``--no-model`` ``miserver serve`` on one SQLite database across its restarts.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import ServerProcess, free_port, wait_for

MODEL = "echo"
IDS = [f"row-{i:02d}" for i in range(12)]


def gateway(tmp_path: Path, base_url: str) -> ServerProcess:
    """A ``--no-model`` gateway of one upstream ``up1`` on ``tmp_path``'s database (the same on every start)."""
    env = {
        "MISERVER_NO_MODEL": "1",
        "MISERVER_UPSTREAMS": f"up1={base_url};max_in_flight=2",
        "MISERVER_UPSTREAM_HEALTH_SECONDS": "0.3",
        "MISERVER_UPSTREAM_BACKOFF_SECONDS": "0.05",
        "BATCH_POLL_SECONDS": "0.2",
    }
    return ServerProcess(data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'gateway.db'}", env=env)


def waiting_reason(batch: Any) -> str | None:
    extra = batch.model_extra or {}
    return extra.get("millm", {}).get("waiting_reason")  # type: ignore[no-any-return]


def test_a_gateway_restarted_while_its_upstream_is_down_waits_for_it(tmp_path: Path) -> None:
    upstream = FakeUpstream(model=MODEL, content_log=tmp_path / "sent.log").start()
    try:
        first = gateway(tmp_path, upstream.base_url).start()
        try:  # discovered at start, and remembered
            assert [m.id for m in first.client().models.list().data] == [MODEL]
        finally:
            first.stop()
        upstream.stop()

        second = gateway(tmp_path, upstream.base_url).start()
        try:
            client = second.client()
            assert [(m.id, m.owned_by) for m in client.models.list().data] == [(MODEL, "upstream:up1")]
            (health,) = second.http().get("/api/health/detailed").json()["upstreams"]
            assert (health["name"], health["live"], health["models"]) == ("up1", False, [MODEL])
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(**chat_body("hi", model=MODEL))
            assert caught.value.status_code == 503, caught.value.body
            assert caught.value.body["code"] == "upstream_unavailable"  # type: ignore[index]
            assert caught.value.response.headers["Retry-After"] == "5"  # when the upstream is probed again

            batch = submit(client, jsonl([line(cid, chat_body(cid, model=MODEL)) for cid in IDS]))
            waiting = wait_for(
                lambda: (b := client.batches.retrieve(batch.id)) and waiting_reason(b) == "upstream_unavailable" and b,
                timeout=120,
            )
            assert waiting.status == "in_progress", waiting
            assert waiting.request_counts is not None and waiting.request_counts.completed == 0
            assert not (tmp_path / "sent.log").exists()  # nothing was sent while it was down

            upstream.start()  # the same port
            done = wait_terminal(client, batch.id, timeout=180)
            assert done.status == "completed", done
            assert done.request_counts is not None and done.request_counts.completed == len(IDS)
            out = read_lines(client, done.output_file_id)
            after = client.chat.completions.create(**chat_body("back", model=MODEL))
        finally:
            second.stop()
    finally:
        upstream.stop()
    assert [x["custom_id"] for x in out] == IDS, "each custom_id once, in input order"
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] == f"echo: {x['custom_id']}" for x in out)
    assert after.choices[0].message.content == "echo: back"
    sent = Counter((tmp_path / "sent.log").read_text().split())
    assert sent == Counter({**dict.fromkeys(IDS, 1), "back": 1})


def test_an_upstream_that_never_answered_is_named_in_the_404(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server = gateway(tmp_path, nowhere).start()
    note = "Upstream 'up1' has not answered GET /v1/models yet; its models are not known."
    try:
        client = server.client()
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(**chat_body("hi", model=MODEL))
        assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert caught.value.body["message"].endswith(f"Models served: none. {note}")  # type: ignore[index]
        done = wait_terminal(client, submit(client, jsonl([line("a", chat_body("hi", model=MODEL))])).id)
    finally:
        server.stop()
    assert done.status == "failed" and done.errors is not None
    (entry,) = done.errors.data or []
    assert (entry.line, entry.code) == (1, "model_not_found") and (entry.message or "").endswith(note)
