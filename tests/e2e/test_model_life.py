"""The resident model's life (issue 15) on the tiny model, through a real ``miserver serve``: weight writes change the
weights revision and the output; a crash between begin and commit leaves the model torn until a load; a checkpoint
save renames the resident model (with the resolution messages of the old id and of a checkpoint not resident); a
batch runs across a commit (rows carry the revision they ran on) or, pinned, waits ``weights_changed``; catalogue
aliases resolve case-insensitively; loads report ``model:loading`` on Socket.IO."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import socketio
import torch
from safetensors.torch import save as save_safetensors

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process, wait_for

ENV = {"BATCH_CHUNK_ROWS": "2", "BATCH_POLL_SECONDS": "0.2"}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("model-life")
    with tiny_server_process(tiny_model_dir, root, env=ENV) as proc:
        yield proc


def chat(http: httpx.Client, model: str = "tiny", content: str = "Say something") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    return http.post("/v1/chat/completions", json=body)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


def revision(http: httpx.Client) -> str:
    return str(ok(http.get("/api/weights"))["weights_revision"])


def test_write_commit_abort_and_the_revision(server: ServerProcess) -> None:
    http = server.http()
    tensors = {t["name"]: t for t in ok(http.get("/api/weights/tensors"))["data"]}
    assert tensors[NORM] == {"name": NORM, "shape": [64], "dtype": "float32"}
    before = chat(http)
    base, text = before.headers["x-millm-weights"], ok(before)["choices"][0]["message"]["content"]
    error(
        http.post("/api/weights/write", json={"tensor": NORM, "op": "scale", "value": -1}),
        409,
        "weights_write_not_open",
    )

    assert ok(http.post("/api/weights/begin"))["torn"] is True
    error(http.post("/api/weights/begin"), 409, "weights_write_open")
    error(chat(http), 409, "weights_torn")  # no request starts mid-write
    # checks name the field, the tensor and the expected shape; nothing is written
    err = error(
        http.post("/api/weights/write", json={"tensor": NORM, "op": "set", "value": [1.0, 2.0]}), 400, "invalid_value"
    )
    assert err["param"] == "value" and NORM in err["message"] and "[64]" in err["message"]
    bad = {"tensor": "model.nope", "op": "add", "value": 1}
    assert error(http.post("/api/weights/write", json=bad), 400, "invalid_value")["param"] == "tensor"
    bad = {"tensor": NORM, "op": "add", "value": 1, "slice": [[70, 80]]}
    assert error(http.post("/api/weights/write", json=bad), 400, "invalid_value")["param"] == "slice"
    bad = {"tensor": NORM, "op": "shift", "value": 1}
    assert error(http.post("/api/weights/write", json=bad), 400, "invalid_value")["param"] == "op"
    # a real write: the final norm negated flips every logit, so the greedy text changes
    ok(http.post("/api/weights/write", json={"tensor": NORM, "op": "scale", "value": -1}))
    committed = http.post("/api/weights/commit")
    new = ok(committed)["weights_revision"]
    assert new != base and committed.headers["x-millm-weights"] == new
    after = chat(http)
    assert after.headers["x-millm-weights"] == new
    assert ok(after)["choices"][0]["message"]["content"] != text

    # abort restores the weights from before begin; the revision stays
    ok(http.post("/api/weights/begin"))
    ok(http.post("/api/weights/write", json={"tensor": NORM, "op": "set", "value": 0.5, "slice": [[0, 32]]}))
    assert ok(http.post("/api/weights/abort"))["weights_revision"] == new
    again = chat(http)
    assert again.headers["x-millm-weights"] == new and again.json()["choices"] == after.json()["choices"]

    # a safetensors upload of the original norm (ones) restores the base weights: a new revision, the base text
    ok(http.post("/api/weights/begin"))
    wrong = save_safetensors({NORM: torch.ones(64, dtype=torch.float64)})
    err = error(
        http.post("/api/weights/write", content=wrong, headers={"Content-Type": "application/octet-stream"}),
        400,
        "invalid_value",
    )
    assert "float64" in err["message"] and "float32" in err["message"]
    upload = save_safetensors({NORM: torch.ones(64)})
    ok(http.post("/api/weights/write", content=upload, headers={"Content-Type": "application/octet-stream"}))
    restored = ok(http.post("/api/weights/commit"))["weights_revision"]
    assert restored not in (base, new)
    assert ok(chat(http))["choices"][0]["message"]["content"] == text
    # a commit that changed nothing keeps the revision
    ok(http.post("/api/weights/begin"))
    assert ok(http.post("/api/weights/commit"))["weights_revision"] == restored
    error(http.post("/api/weights/commit"), 409, "weights_write_not_open")


def test_lease_rules_of_weight_writes(server: ServerProcess) -> None:
    http = server.http()
    lease = ok(http.post("/api/lease", json={"holder": "alice", "ttl_seconds": 60}))["lease"]
    try:
        error(http.post("/api/weights/begin"), 409, "lease_held")
        error(http.post("/api/checkpoints", json={"model": "x"}), 409, "lease_held")
        ok(http.post("/api/weights/begin", headers={"X-miLLM-Lease": lease}))
        error(http.post("/api/weights/abort"), 409, "lease_held")
        ok(http.post("/api/weights/abort", headers={"X-miLLM-Lease": lease}))
    finally:
        http.post(f"/api/lease/{lease}/release")


def rows(n: int, max_tokens: int, *, quick: int = 0) -> bytes:
    """``n`` chat rows of ``max_tokens`` each, but the first ``quick`` rows of 4 tokens: a test that waits for the
    first recorded row then has the long rows' time to act while the batch still runs."""
    return jsonl(
        line(f"r{i:02d}", chat_body(f"Tell me about {i}", max_tokens=4 if i < quick else max_tokens)) for i in range(n)
    )


def revisions(client: Any, batch: Any) -> list[str]:
    out = read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i:02d}" for i in range(len(out))]
    return [x["response"]["millm"]["headers"]["X-miLLM-Weights"] for x in out]


def commit_negated_norm(http: httpx.Client, lease: str) -> str:
    headers = {"X-miLLM-Lease": lease}
    ok(http.post("/api/weights/begin", headers=headers))
    ok(http.post("/api/weights/write", json={"tensor": NORM, "op": "scale", "value": -1}, headers=headers))
    return str(ok(http.post("/api/weights/commit", headers=headers))["weights_revision"])


def test_a_batch_across_a_commit_with_and_without_the_pin(server: ServerProcess) -> None:
    client, http = server.client(), server.http()
    lease = ok(http.post("/api/lease", json={"holder": "alice", "ttl_seconds": 300}))["lease"]
    headers = {"X-miLLM-Lease": lease}
    try:
        ok(http.post("/api/models/load", json={"model": "tiny"}, headers=headers))  # the weights of its source
        old = revision(http)
        # unpinned: rows recorded before the commit carry the old revision, rows after it the new one
        batch = submit(client, rows(10, 64, quick=2), extra_headers=headers)
        wait_for(lambda: (client.batches.retrieve(batch.id).request_counts.completed or 0) >= 1, timeout=120)
        new = commit_negated_norm(http, lease)
        done = wait_terminal(client, batch.id, timeout=600)
        assert done.status == "completed"
        seen = revisions(client, done)
        assert seen[0] == old and seen[-1] == new and set(seen) == {old, new}
        assert seen == sorted(seen, key=lambda r: r == new)  # never mixed: old ones, then new ones

        # pinned to the revision it started on: once the revision changes, the remaining rows wait
        pinned = submit(client, rows(10, 64, quick=2), extra_headers=headers, extra_body={"weights_revision": new})
        assert pinned.model_extra is not None and pinned.model_extra["millm"]["weights_revision"] == new
        wait_for(lambda: (client.batches.retrieve(pinned.id).request_counts.completed or 0) >= 1, timeout=120)
        newer = commit_negated_norm(http, lease)  # negated twice: the base weights, under a third revision
        assert newer not in (old, new)

        def waiting() -> Any:
            b = client.batches.retrieve(pinned.id)
            return b.status == "in_progress" and b.model_extra["millm"]["waiting_reason"] == "weights_changed" and b

        paused = wait_for(waiting, timeout=60)
        count = paused.request_counts.completed
        assert 1 <= count < 10 and client.batches.retrieve(pinned.id).request_counts.completed == count
        # a load brings the base weights back (revision ``old``: still not the pin); the same write on them gives
        # the same contents, hence the same chained revision ``new``: the pinned batch runs on to its end
        ok(http.post("/api/models/load", json={"model": "tiny"}, headers=headers))
        assert revision(http) == old
        assert commit_negated_norm(http, lease) == new
        final = wait_terminal(client, pinned.id, timeout=600)
        assert final.status == "completed"
        assert set(revisions(client, final)) == {new}  # every row on the one revision it was pinned to
    finally:
        http.post(f"/api/lease/{lease}/release")


def test_checkpoint_save_resolution_and_load(server: ServerProcess) -> None:
    client, http = server.client(), server.http()
    ok(http.post("/api/models/load", json={"model": "tiny"}))
    ok(http.post("/api/weights/begin"))
    ok(http.post("/api/weights/write", json={"tensor": NORM, "op": "scale", "value": 2}))
    ok(http.post("/api/weights/commit"))
    score = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 1, "logprobs": 5, "temperature": 0}
    logits = ok(http.post("/v1/completions", json=score))["choices"][0]["logprobs"]["top_logprobs"]
    error(http.post("/api/checkpoints", json={"model": "tiny"}), 409, "model_exists")
    assert error(http.post("/api/checkpoints", json={}), 400, "missing_required_parameter")["param"] == "model"

    saved = http.post("/api/checkpoints", json={"model": "tiny-ck"})
    ck = ok(saved)
    assert ck["id"] == "tiny-ck" and ck["base_model"] == "tiny" and ck["bytes"] > 0
    assert saved.headers["x-millm-weights"] == ck["weights_revision"]
    assert [m.id for m in client.models.list()] == ["tiny-ck"]
    # the catalogue id whose weights the save renamed: 404 naming the resident id, on the route and in a batch line
    err = error(chat(http, "tiny"), 404, "model_not_found")
    assert "'tiny-ck'" in err["message"]
    batch = wait_terminal(client, submit(client, jsonl([line("a", chat_body("hi", model="tiny"))])).id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert batch.errors.data[0].code == "model_not_found" and batch.errors.data[0].message == err["message"]
    listed = {m["id"]: m for m in ok(http.get("/api/models"))["data"]}
    assert listed["tiny-ck"]["resident"] and listed["tiny-ck"]["kind"] == "checkpoint"
    assert not listed["tiny"]["resident"]
    assert error(http.delete("/api/checkpoints/tiny-ck"), 409, "checkpoint_resident")

    # a checkpoint that exists but is not resident: its own message; a load brings it back with identical logits
    ok(http.post("/api/models/load", json={"model": "tiny"}))
    err = error(chat(http, "tiny-ck"), 404, "model_not_found")
    assert "Checkpoint 'tiny-ck' is not resident; load it first" in err["message"]
    loaded = ok(http.post("/api/models/load", json={"model": "tiny-ck"}))
    assert loaded["weights_revision"] == ck["weights_revision"]
    score["model"] = "tiny-ck"
    assert ok(http.post("/v1/completions", json=score))["choices"][0]["logprobs"]["top_logprobs"] == logits
    ok(http.post("/api/models/load", json={"model": "tiny"}))
    assert ok(http.delete("/api/checkpoints/tiny-ck"))["deleted"] is True
    assert ok(http.get("/api/checkpoints"))["data"] == []
    error(http.delete("/api/checkpoints/tiny-ck"), 404, "checkpoint_not_found")


def test_catalogue_aliases_cli_and_loading_events(server: ServerProcess, tiny_model_dir: Path) -> None:
    http = server.http()
    added = subprocess.run(
        [
            sys.executable,
            "-m",
            "miserver.cli",
            "models",
            "--url",
            server.base_url,
            "add",
            "tiny",
            str(tiny_model_dir),
            "--alias",
            "Tiny-Model",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert added.returncode == 0, added.stderr
    entry = {m["id"]: m for m in ok(http.get("/api/models"))["data"]}["tiny"]
    assert entry["aliases"] == ["Tiny-Model"] and entry["kind"] == "directory" and entry["bytes"] > 0
    assert entry["resident"] and entry["weights_revision"] == revision(http) and entry["dtype"] == "float32"
    assert chat(http, "tiny-model").status_code == 200  # an alias, in any case
    assert chat(http, "TINY").status_code == 404  # ids compare case-sensitively
    bad = http.post("/api/models", json={"id": "x", "source": "/nowhere"})
    assert error(bad, 400, "invalid_value")["param"] == "source"

    events: list[dict[str, Any]] = []
    lock = threading.Lock()
    sio = socketio.Client(reconnection=False)
    sio.on("model:loading", lambda data: lock.acquire() and (events.append(data), lock.release()))
    sio.connect(server.base_url, socketio_path="socket.io", wait_timeout=30)
    try:
        ok(http.post("/api/models/unload"))
        assert ok(http.post("/api/models/load", json={"model": "TINY-MODEL"}))["id"] == "tiny"
        wait_for(lambda: any(e["stage"] == "loaded" for e in events), timeout=30)
    finally:
        sio.disconnect()
    assert [e["stage"] for e in events] == ["loading", "loaded"] and events[-1]["model"] == "tiny"


def crash_mid_write(tiny_model_dir: Path, root: Path) -> None:
    """Start a server on ``root``, begin a weight write, write, and kill it (-9) before the commit."""
    server = tiny_server_process(tiny_model_dir, root, env=ENV).start()
    http = server.http()
    ok(http.post("/api/weights/begin"))
    ok(http.post("/api/weights/write", json={"tensor": NORM, "op": "add", "value": 1}))
    server.kill9()


def test_a_crash_between_begin_and_commit_leaves_the_model_torn(tiny_model_dir: Path, tmp_path: Path) -> None:
    crash_mid_write(tiny_model_dir, tmp_path)
    with tiny_server_process(tiny_model_dir, tmp_path, env=ENV) as server:
        http, client = server.http(), server.client()
        state = ok(http.get("/api/weights"))
        assert state["torn"] is True and state["write_open"] is False
        error(chat(http), 409, "weights_torn")
        batch = submit(client, rows(3, 2))
        wait_for(
            lambda: (
                (b := client.batches.retrieve(batch.id)).status == "in_progress"
                and b.model_extra["millm"]["waiting_reason"] == "weights_torn"
            ),
            timeout=60,
        )
        assert client.batches.retrieve(batch.id).request_counts.completed == 0
        # a late commit accepts the resident weights as they are (here: as loaded, the write died with the process)
        late = ok(http.post("/api/weights/commit"))
        assert late["torn"] is False
        assert chat(http).status_code == 200
        assert wait_terminal(client, batch.id).status == "completed"
        base = late["weights_revision"]
        ok(http.post("/api/weights/begin"))
        server.kill9()
    with tiny_server_process(tiny_model_dir, tmp_path, env=ENV) as server:
        http = server.http()
        error(chat(http), 409, "weights_torn")
        ok(http.post("/api/models/load", json={"model": "tiny"}))  # a load restores whole weights
        assert ok(http.get("/api/weights"))["torn"] is False and revision(http) == base
        assert chat(http).status_code == 200
