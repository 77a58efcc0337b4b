"""A real ``miserver serve`` process on a free port, for end-to-end tests (driven with the official SDK)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """Spawns ``python -m miserver.cli serve``; ``start()`` returns once ``/api/health`` answers 200."""

    def __init__(
        self,
        *,
        model: str,
        database_url: str,
        data_dir: Path,
        served_model_name: str | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.model = model
        self.database_url = database_url
        self.data_dir = data_dir
        self.served_model_name = served_model_name
        self.extra_env = env or {}
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / f"server-{self.port}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "miserver.cli", "serve",
            "--port", str(self.port),
            "--data-dir", str(self.data_dir),
            "--database-url", self.database_url,
            "--model", self.model,
            "--log-level", "warning",
        ]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        env = {**os.environ, **self.extra_env}
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official SDK in strict response validation, as every end-to-end test uses it."""
        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key="test", _strict_response_validation=True, max_retries=0, **kwargs
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60.0)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``sig`` (SIGTERM: graceful; SIGKILL: a crash) and wait for the process to end."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)

    def kill9(self) -> int | None:
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


def tiny_server_process(
    model_dir: Path,
    root: Path,
    *,
    database_url: str | None = None,
    served_model_name: str = "tiny",
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> ServerProcess:
    """A (not yet started) server for the tiny model with its files under ``root``.

    Defaults: SQLite at ``root/miserver.db``, data dir ``root/var``, ``MISERVER_EXECUTION_LOG`` at
    ``root/executions.log``; ``env`` adds or overrides variables. Construct it again with the same arguments (and a
    new port) to restart a server on the same database and data directory.
    """
    return ServerProcess(
        model=str(model_dir),
        served_model_name=served_model_name,
        database_url=database_url or f"sqlite:///{root / 'miserver.db'}",
        data_dir=root / "var",
        env={"MISERVER_EXECUTION_LOG": str(root / "executions.log"), **(env or {})},
        port=port,
    )


class WorkerProcess:
    """Spawns ``python -m miserver.cli worker``; ``start()`` returns once it logged that it is ready."""

    def __init__(self, *, model: str, database_url: str, data_dir: Path, served_model_name: str | None = None,
                 env: dict[str, str] | None = None, name: str = "worker") -> None:  # fmt: skip
        self.model = model
        self.database_url = database_url
        self.data_dir = data_dir
        self.served_model_name = served_model_name
        self.extra_env = env or {}
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / f"{name}.log"

    def start(self, timeout: float = 120.0) -> WorkerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "miserver.cli", "worker", "--database-url", self.database_url,
               "--data-dir", str(self.data_dir), "--model", self.model, "--worker-id", self.name]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.extra_env}
            )
        wait_for(lambda: self.proc.poll() is not None or f"worker {self.name} ready" in self.log(), timeout=timeout)
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
