"""A ``miserver serve`` (or ``miserver worker``) child process on a free port: the one spawning helper shared by the
end-to-end tests, the benchmarks and the demo.

Example::

    from miserver.process import ServerProcess

    with ServerProcess(data_dir=Path("var/try"), database_url="sqlite:///var/try/miserver.db") as server:
        client = server.client()                      # the official SDK, strict response validation
        print(client.models.list())

``start()`` returns once ``GET /api/health`` answers 200 and raises ``RuntimeError`` with the tail of the server's
log when the process exits or is not ready in time. ``stop()`` sends SIGTERM (graceful: the running row finishes);
``kill9()`` simulates a crash.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChildProcess(Protocol):
    """What this module needs of a started child: :class:`subprocess.Popen`'s ``pid``, ``returncode`` (``-N``
    after signal N), ``poll``, ``wait`` (raising :class:`subprocess.TimeoutExpired`), ``send_signal`` and ``kill``."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def popen(cmd: list[str], env: dict[str, str], log_path: Path, new_session: bool) -> ChildProcess:
    """Run ``cmd`` with exactly ``env``, its stdout and stderr appended to ``log_path``; ``new_session``: in its own
    session (a Ctrl-C in the terminal reaches the parent only)."""
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)


#: How :class:`ServerProcess` and :class:`WorkerProcess` start their child ``[python, "-m", "miserver.cli", ...]``:
#: a new interpreter. The test suite swaps in a fork server that has imported torch already
#: (``tests/support/forkserver.py``).
SPAWN: Callable[[list[str], dict[str, str], Path, bool], ChildProcess] = popen


def stop_process(proc: ChildProcess | None, sig: int, timeout: float) -> int | None:
    """Send ``sig`` to ``proc`` (if it runs) and wait up to ``timeout`` seconds for it to end, then SIGKILL it;
    returns its exit status (None when it never started)."""
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


class ServerProcess:
    """Spawns ``python -m miserver.cli serve``; ``start()`` returns once ``/api/health`` answers 200.

    ``model`` None serves the embedded default; ``database_url`` None uses the server's default (SQLite under
    ``data_dir``). ``new_session`` starts the child in its own session, so that a Ctrl-C in the terminal reaches the
    parent only (the demo stops the server itself). The server's output goes to ``log_path`` (under ``data_dir``).
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        model: str | None = None,
        database_url: str | None = None,
        served_model_name: str | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        log_level: str = "warning",
        new_session: bool = False,
    ) -> None:
        self.model = model
        self.log_level = log_level
        self.new_session = new_session
        self.database_url = database_url
        self.data_dir = data_dir
        self.served_model_name = served_model_name
        self.extra_env = env or {}
        self.port = port or free_port()
        self.proc: ChildProcess | None = None
        self.log_path = data_dir / f"server-{self.port}.log"
        # the clients handed out, closed by stop(): an unclosed connection is a ResourceWarning (an error in tests)
        self._clients: list[openai.OpenAI | httpx.Client] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "miserver.cli",
            "serve",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--log-level",
            self.log_level,
        ]
        if self.database_url:
            cmd += ["--database-url", self.database_url]
        if self.model:
            cmd += ["--model", self.model]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        self.proc = SPAWN(cmd, {**os.environ, **self.extra_env}, self.log_path, self.new_session)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/api/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self, chars: int = 5000) -> str:
        """The last ``chars`` characters of the server's output."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def client(self, api_key: str = "test", **kwargs: Any) -> openai.OpenAI:
        """The official SDK in strict response validation, as every end-to-end test uses it, presenting ``api_key``
        (any value on a server without keys). Closed by :meth:`stop`."""
        client = openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, _strict_response_validation=True, max_retries=0, **kwargs
        )
        self._clients.append(client)
        return client

    def http(self) -> httpx.Client:
        """An httpx client on the server's base URL (60 s timeout). Closed by :meth:`stop`."""
        client = httpx.Client(base_url=self.base_url, timeout=60.0)
        self._clients.append(client)
        return client

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` (SIGTERM: graceful; SIGKILL: a crash) and wait for the process to end; close the clients
        handed out."""
        while self._clients:
            self._clients.pop().close()
        return stop_process(self.proc, sig, timeout)

    def kill9(self) -> int | None:
        """A crash: SIGKILL, then wait for the process to end."""
        return self.stop(signal.SIGKILL)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: Any, timeout: float = 120.0, interval: float = 0.1) -> Any:
    """Poll ``predicate()`` until it returns a truthy value (returned) or ``timeout`` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class WorkerProcess:
    """Spawns ``python -m miserver.cli worker`` (runner and engine, no HTTP) on a shared PostgreSQL database;
    ``start()`` returns once it logged that it is ready."""

    def __init__(
        self,
        *,
        model: str,
        database_url: str,
        data_dir: Path,
        served_model_name: str | None = None,
        env: dict[str, str] | None = None,
        name: str = "worker",
    ) -> None:
        self.model = model
        self.database_url = database_url
        self.data_dir = data_dir
        self.served_model_name = served_model_name
        self.extra_env = env or {}
        self.name = name
        self.proc: ChildProcess | None = None
        self.log_path = data_dir / f"{name}.log"

    def start(self, timeout: float = 120.0) -> WorkerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "miserver.cli",
            "worker",
            "--database-url",
            self.database_url,
            "--data-dir",
            str(self.data_dir),
            "--model",
            self.model,
            "--worker-id",
            self.name,
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        self.proc = SPAWN(cmd, {**os.environ, **self.extra_env}, self.log_path, False)
        wait_for(lambda: self.proc.poll() is not None or f"worker {self.name} ready" in self.log(), timeout=timeout)
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def log(self) -> str:
        """The last 5,000 characters of the worker's output."""
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` and wait for the process to end; returns its exit status."""
        return stop_process(self.proc, sig, timeout)
