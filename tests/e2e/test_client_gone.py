"""A request whose client hangs up stops at once and frees the engine, on every synchronous inference route.

The proof is the engine's own count of generated tokens (``miserver_engine_generated_tokens`` on ``/metrics``), not
a wall-clock time: an abandoned request of ``max_tokens`` 300 that ran to its end would add 300 tokens before the
next request got the engine; one that stopped adds a few.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess, tiny_server_process, wait_for

LONG = 300
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
#: route -> a body that generates LONG tokens unless stopped (greedy, so its length is known from a full run)
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "max_tokens": LONG, "temperature": 0},
    "/v1/completions": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0},
    "/v1/responses": {"model": "tiny", "input": "Tell me a long story.", "max_output_tokens": LONG, "temperature": 0},
    "/anthropic/v1/messages": {"model": "tiny", "messages": MESSAGES, "max_tokens": LONG, "temperature": 0},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # one sequence at a time, so that a second request really waits for the engine's slot (the step scheduler would
    # otherwise run it beside the first)
    env = {"MISERVER_MAX_SEQUENCES": "1"}
    with tiny_server_process(tiny_model_dir, tmp_path_factory.mktemp("gone"), log_level="info", env=env) as proc:
        yield proc


def generated(server: ServerProcess) -> int:
    """The engine's generated-token count, read from ``/metrics``."""
    text = server.http().get("/metrics").text
    m = re.search(r"^miserver_engine_generated_tokens (\d+(?:\.\d+)?)", text, re.M)
    assert m, "no miserver_engine_generated_tokens on /metrics"
    return int(float(m.group(1)))


def waiting(server: ServerProcess) -> int:
    """Interactive requests waiting for the engine (at the gate or for a scheduler slot), read from ``/metrics``."""
    text = server.http().get("/metrics").text
    m = re.search(r'^miserver_admission_queue_depth\{priority="interactive"\} (\d+(?:\.\d+)?)', text, re.M)
    assert m, "no interactive queue depth on /metrics"
    return int(float(m.group(1)))


def send_and_hang_up(server: ServerProcess, path: str, body: dict[str, Any], before: int) -> None:
    """Send the request on a raw connection, wait until the engine is generating it, then close the connection."""
    data = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_for(lambda: generated(server) > before, timeout=60, interval=0.05)


@pytest.mark.parametrize("path", list(ROUTES))
def test_an_abandoned_request_stops_and_the_next_one_gets_the_engine(server: ServerProcess, path: str) -> None:
    http = server.http()
    body = ROUTES[path]
    start = generated(server)
    full = http.post(path, json=body, timeout=300)  # the same request, not abandoned: it makes all LONG tokens
    assert full.status_code == 200, full.text
    assert generated(server) - start == LONG, "the control request must run to max_tokens for the test to mean it"

    before = generated(server)
    send_and_hang_up(server, path, body, before)
    short = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert short.status_code == 200
    made = generated(server) - before
    assert made < LONG // 2, f"the abandoned request went on generating ({made} tokens)"
    wait_for(lambda: "client went away before the answer" in server.log(20_000), timeout=30)
    assert f"POST {path} cancelled" in server.log(20_000)


def test_an_abandoned_request_waiting_for_the_engine_never_runs(server: ServerProcess) -> None:
    """Two abandoned requests, the second queued behind the first: neither runs on once its client is gone."""
    before = generated(server)
    body = ROUTES["/v1/chat/completions"]
    data = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    with socket.create_connection((host, int(port))) as first, socket.create_connection((host, int(port))) as second:
        first.sendall(request)
        wait_for(lambda: generated(server) > before, timeout=60, interval=0.05)
        second.sendall(request)
        wait_for(lambda: waiting(server) == 1, timeout=60, interval=0.05)  # queued for the engine behind the first
    short = server.http().post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert short.status_code == 200
    assert generated(server) - before < LONG // 2
