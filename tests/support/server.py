"""The test suite's servers: :mod:`miserver.process` (the one spawning helper) and the tiny model's server."""

from __future__ import annotations

from pathlib import Path

from miserver.process import ServerProcess, WorkerProcess, free_port, wait_for
from miserver.settings import EMBEDDED_MODEL_ID

__all__ = ["ServerProcess", "WorkerProcess", "free_port", "real_model_server", "tiny_server_process", "wait_for"]


def real_model_server(root: Path) -> ServerProcess:
    """A (not yet started) server for the embedded SmolLM2 with its files under ``root`` (SQLite), its forward passes
    on one torch thread: the suite's other worker keeps the second core busy, and two torch threads on a shared core
    spend their time waiting for each other."""
    return ServerProcess(
        model=EMBEDDED_MODEL_ID,
        database_url=f"sqlite:///{root / 'miserver.db'}",
        data_dir=root / "var",
        env={"MISERVER_TORCH_THREADS": "1"},
    )


def tiny_server_process(
    model_dir: Path,
    root: Path,
    *,
    database_url: str | None = None,
    served_model_name: str = "tiny",
    env: dict[str, str] | None = None,
    port: int | None = None,
    log_level: str = "warning",
) -> ServerProcess:
    """A (not yet started) server for the tiny model with its files under ``root``.

    Defaults: SQLite at ``root/miserver.db``, data dir ``root/var``, ``MISERVER_EXECUTION_LOG`` at
    ``root/executions.log``, log level ``warning``; ``env`` adds or overrides variables. Construct it again with the
    same arguments (and a new port) to restart a server on the same database and data directory.
    """
    return ServerProcess(
        model=str(model_dir),
        served_model_name=served_model_name,
        database_url=database_url or f"sqlite:///{root / 'miserver.db'}",
        data_dir=root / "var",
        env={"MISERVER_EXECUTION_LOG": str(root / "executions.log"), **(env or {})},
        port=port,
        log_level=log_level,
    )
