"""Shared fixtures of the test suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.databases import database
from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a transformers folder (built once a session).

    The tokenizer comes from ``MISERVER_CACHE_DIR`` (default ``~/.cache/miserver``), converted there if needed.
    """
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


DATABASE_KINDS = ["sqlite", "postgresql"]


@pytest.fixture(params=DATABASE_KINDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: every store and end-to-end test runs once on SQLite and once on PostgreSQL."""
    with database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def tiny_server(tiny_model_dir: Path, database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    """A running ``miserver serve`` with the tiny model (served as ``tiny``) on a fresh database."""
    server = ServerProcess(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        database_url=database_url,
        data_dir=tmp_path / "var",
        env={"MISERVER_EXECUTION_LOG": str(tmp_path / "executions.log")},
    )
    with server:
        yield server
