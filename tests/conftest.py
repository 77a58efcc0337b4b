"""Shared fixtures of the test suite."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from miserver.engines.local.engine import LocalEngine
from miserver.store import Store
from tests.support import forkserver
from tests.support.databases import database
from tests.support.server import ServerProcess, tiny_server_process
from tests.support.tiny_model import build_tiny_model

# servers start from a fork server that has imported torch and transformers (2 s instead of 10 s each, some seventy
# starts); MISERVER_TEST_SPAWN=1 spawns a new interpreter for each, as outside the tests
if not os.environ.get("MISERVER_TEST_SPAWN"):
    forkserver.install()

#: Modules that take longest (wall seconds measured on these 2 cores with two pytest workers), run first: ``make
#: test`` hands whole modules to two workers in collection order (``--dist loadfile --no-loadscope-reorder``), so a
#: long module that starts late would run alone at the end while the other worker idles.
LONGEST_FIRST = (
    "tests/e2e/test_real_model.py",
    "tests/e2e/test_exactly_once.py",
    "tests/e2e/test_restart.py",
    "tests/e2e/test_leases.py",
    "tests/e2e/test_scale_out.py",
    "tests/e2e/test_batches_api.py",
    "tests/e2e/test_scoring_embeddings_probes.py",
    "tests/e2e/test_model_life.py",
    "tests/e2e/test_accounts.py",
    "tests/e2e/test_schema_fuzz.py",
    "tests/e2e/test_console.py",
    "tests/unit/test_engine_local.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order modules longest first (:data:`LONGEST_FIRST`), the rest as collected; tests keep their order within a
    module."""
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


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
async def store(database_url: str) -> AsyncIterator[Store]:
    """An open :class:`~miserver.store.Store` on a fresh database (each kind in turn), closed after the test."""
    s = await Store.open(database_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    """The tiny model in an in-process :class:`LocalEngine` on the CPU, served as ``tiny``, shared by a module."""
    eng = asyncio.run(LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu"))
    yield eng
    asyncio.run(eng.close())


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


# -- module- and session-scoped servers (one start shared by many tests; each start costs seconds) ---------------


@pytest.fixture(scope="module", params=DATABASE_KINDS)
def module_database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh database of each kind, shared by the tests of one module."""
    with database(request.param, tmp_path_factory.mktemp(f"db-{request.param}")) as url:
        yield url


@pytest.fixture(scope="module")
def module_server(
    tiny_model_dir: Path, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Like ``tiny_server`` (served as ``tiny``, SQLite then PostgreSQL), started once for a module's tests.

    Tests sharing it must leave no batch running when they end (wait for a terminal status).
    """
    root = tmp_path_factory.mktemp("server")
    with tiny_server_process(tiny_model_dir, root, database_url=module_database_url) as server:
        yield server


@pytest.fixture(scope="module")
def sqlite_module_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model served as ``tiny`` on SQLite, shared by a module whose tests do not depend on the database."""
    root = tmp_path_factory.mktemp("server")
    with tiny_server_process(tiny_model_dir, root) as server:
        yield server


QUANTIZED_ID = "org/Tiny-GGUF:Q4_1"


@pytest.fixture(scope="session")
def quantized_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model served under a quantization-style id (``QUANTIZED_ID``) on SQLite, for the model-prefix cases.

    Session-scoped: the synchronous and the batch tests of the prefix message share one start.
    """
    root = tmp_path_factory.mktemp("quantized-server")
    with tiny_server_process(tiny_model_dir, root, served_model_name=QUANTIZED_ID) as server:
        yield server
