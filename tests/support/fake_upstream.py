"""A small real OpenAI-compatible HTTP server for gateway tests and benchmarks: run as a module.

It is kept for what a real engine cannot be made to do on demand: answer 503 a set number of times in each engine's
error dialect, hang or answer late, cut a stream, send an error chunk inside a 200 stream, drop a connection at the
moment it is reused, and answer instantly with a fixed text so that tests can count rows sent and resent. The
gateway's ordinary journey (chat, completions, streams, batches, error envelopes, an engine killed mid-batch) runs
against real engines: ``transformers serve`` in ``tests/e2e/test_gateway_transformers.py`` (every run) and
``llama-server`` in ``tests/e2e/test_gateway_llamacpp.py`` (when a binary is found).

It answers ``GET /v1/models`` and ``POST /v1/chat/completions`` with a fixed answer after ``--delay`` seconds (one
thread per connection, so requests really overlap), and can misbehave on purpose: ``--fail-first N`` answers the
first N completions with 503 and ``Retry-After: 0`` (then recovers), ``--cut-stream`` sends two chunks of a stream and
closes the connection without ``[DONE]``, ``--error-chunk`` sends an error chunk inside a 200 stream, ``--envelope``
picks the error dialect of the 503 (``openai``, ``sglang``, ``tgi``, ``ollama``). Every completion request's
``X-Request-Id`` is appended to ``--log`` when given, and its last message's content to ``--content-log`` (which
row was sent, how many times). ``--drop-reused`` reads every request after the first on a kept-alive connection and
closes the connection without an answer: what a server does when its keep-alive timeout ends a connection at the
moment the client reuses it. Not a mock: the gateway talks to it over TCP like to any
upstream.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from miserver.process import free_port, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]

ENVELOPES: dict[str, Any] = {
    "openai": {"error": {"message": "overloaded", "type": "server_error", "param": None, "code": None}},
    "sglang": {"object": "error", "message": "overloaded", "type": "ServiceUnavailable", "param": None, "code": 503},
    "tgi": {"error": "overloaded", "error_type": "overloaded"},
    "ollama": {"error": "overloaded"},
}


def completion(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def chunk(model: str, text: str, finish: str | None = None) -> bytes:
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


def make_handler(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()
    state = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: Any) -> None:  # quiet
            pass

        def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _dropped(self) -> bool:
            """With --drop-reused: True (and the connection closed unanswered) for a request on a reused connection."""
            served = getattr(self, "served", 0)
            self.served = served + 1
            if args.drop_reused and served >= 1:
                self.close_connection = True
                return True
            return False

        def do_GET(self) -> None:
            if self._dropped():
                return
            if self.path.rstrip("/") == "/v1/models":
                entry = {"id": args.model, "object": "model", "created": 0, "owned_by": "fake"}
                if args.max_model_len:
                    entry["max_model_len"] = args.max_model_len
                self._json(200, {"object": "list", "data": [entry]})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self._dropped():
                return
            if self.path != "/v1/chat/completions":
                self._json(404, {"detail": "Not Found"})
                return
            with lock:
                state["requests"] += 1
                n = state["requests"]
            if args.log:
                with open(args.log, "a") as fh:
                    fh.write(f"{self.headers.get('X-Request-Id')}\n")
            if args.content_log:
                with lock, open(args.content_log, "a") as fh:
                    fh.write(f"{body['messages'][-1]['content']}\n")
            if n <= args.fail_first:
                self._json(503, ENVELOPES[args.envelope], {"Retry-After": "0"})
                return
            if args.delay:
                time.sleep(args.delay)
            text = f"echo: {body['messages'][-1]['content']}"
            if not body.get("stream"):
                self._json(200, completion(args.model, text))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if args.cut_stream:
                self.send_header("Connection", "close")
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            parts = [chunk(args.model, "echo: "), chunk(args.model, body["messages"][-1]["content"])]
            if args.error_chunk:
                parts.append(b'data: {"error": {"message": "engine crashed", "type": "server_error", "code": 500}}\n\n')
            elif not args.cut_stream:
                parts += [chunk(args.model, "", "stop"), b"data: [DONE]\n\n"]
            for part in parts:
                if args.cut_stream:
                    self.wfile.write(part)
                else:
                    self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.flush()
            if args.cut_stream:
                self.close_connection = True
                return
            self.wfile.write(b"0\r\n\r\n")

    return Handler


class FakeUpstream:
    """This module's server as a child process on a free port: ``start()`` returns once ``GET /v1/models`` answers;
    ``stop()`` ends it (SIGTERM, or ``kill9()``). ``options`` become command-line flags (``fail_first=2`` ->
    ``--fail-first 2``; ``True`` -> a bare flag)."""

    def __init__(self, **options: Any) -> None:
        self.port = free_port()
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeUpstream:
        cmd = [sys.executable, "-m", "tests.support.fake_upstream", "--port", str(self.port)]
        for key, value in self.options.items():
            flag = "--" + key.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(lambda: self._ready(), timeout=30)
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"fake upstream exited with {self.proc.returncode}")
        try:
            return httpx.get(self.base_url + "/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig, 10)

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--envelope", choices=sorted(ENVELOPES), default="openai")
    parser.add_argument("--cut-stream", action="store_true")
    parser.add_argument("--error-chunk", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--log", default=None)
    parser.add_argument("--content-log", default=None)
    parser.add_argument("--drop-reused", action="store_true")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args))
    server.daemon_threads = True
    server.request_queue_size = 128
    print(f"fake upstream ready on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
