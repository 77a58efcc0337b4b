"""Live progress: a real python-socketio client hears ``batch:progress`` on every change of status or counts."""

from __future__ import annotations

import threading
from typing import Any

import socketio

from tests.support.batches import chat_body, jsonl, line, submit, wait_terminal
from tests.support.server import ServerProcess, wait_for


def test_batch_progress_events(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    batch = submit(client, jsonl(line(f"r{i}", chat_body(f"Count to {i}", max_tokens=8)) for i in range(12)))
    events: list[dict[str, Any]] = []
    lock = threading.Lock()
    sio = socketio.Client(reconnection=False)

    @sio.on("batch:progress")
    def on_progress(data: dict[str, Any]) -> None:
        with lock:
            events.append(data)

    sio.connect(tiny_server.base_url, socketio_path="socket.io", wait_timeout=30)
    try:
        ack = sio.call("subscribe", {"batch_id": batch.id}, timeout=30)
        assert ack == {"ok": True}
        assert sio.call("subscribe", {"batch_id": "batch_nope"}, timeout=30)["ok"] is False
        done = wait_terminal(client, batch.id)
        wait_for(lambda: events and events[-1]["status"] == "completed", timeout=30)
    finally:
        sio.disconnect()
    assert done.status == "completed"
    with lock:
        seen = list(events)
    assert all(e["id"] == batch.id for e in seen)
    assert {"in_progress", "completed"} <= {e["status"] for e in seen}
    done_counts = [e["request_counts"]["completed"] for e in seen]
    assert done_counts == sorted(done_counts)  # counts never go back
    assert seen[-1]["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    changes = {(e["status"], e["request_counts"]["completed"], e["millm"]["waiting_reason"]) for e in seen}
    assert len(changes) == len(seen)  # one event per change, never the same state twice
    assert set(seen[0]) == {"id", "status", "request_counts", "millm"}
