"""A real HTTP server in a thread that records webhook deliveries (issue 14's tests)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    """One request as received: its headers (lower-case names), body and the status it was answered with."""

    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class Receiver:
    """Answers every POST with ``status`` (settable while it runs) and records it in ``received``; with ``hold`` set,
    a request waits for ``hold`` to be set before it is recorded and answered (an endpoint that does not answer),
    and ``waiting`` counts the requests it holds."""

    status: int = 200
    hold: threading.Event | None = None
    waiting: int = 0
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def delivered(self) -> list[Received]:
        """The requests answered 2xx."""
        with self.lock:
            return [r for r in self.received if 200 <= r.status < 300]

    def all(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def __enter__(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if receiver.hold is not None:
                    with receiver.lock:
                        receiver.waiting += 1
                    receiver.hold.wait(timeout=120)
                    with receiver.lock:
                        receiver.waiting -= 1
                status = receiver.status
                with receiver.lock:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    receiver.received.append(Received(headers, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
