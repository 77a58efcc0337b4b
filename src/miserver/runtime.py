"""The pieces a serving process runs, built in one place for ``miserver serve`` and ``miserver worker``:
the store, the resident engine, its admission gate and lease, the residency manager and the batch runner."""

from __future__ import annotations

import hashlib
import random
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from .batches.runner import BatchRunner
from .engines.base import Engine, GenerationRequest, PoolRequest
from .scheduler import AdmissionGate
from .services.context import ServiceContext
from .services.residency import Residency
from .settings import Settings
from .store import Store

EngineFactory = Callable[[Settings], Awaitable[Engine]]


async def load_engine(settings: Settings) -> Engine:
    """The resident engine for ``settings.model`` (imported lazily: torch is heavy)."""
    from .engines.local.engine import LocalEngine

    return await LocalEngine.start(
        model=settings.model,
        served_model_name=settings.served_model_name,
        cache_dir=settings.cache_dir,
        device=settings.device,
    )


def execution_logger(path: Path) -> Callable[[GenerationRequest | PoolRequest], None]:
    """An ``on_execute`` hook appending ``sha256(prompt ids)`` per engine execution to ``path`` (flushed at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log_execution(request: GenerationRequest | PoolRequest) -> None:
        digest = hashlib.sha256(",".join(map(str, request.prompt_ids)).encode()).hexdigest()[:16]
        with path.open("a") as fh:
            fh.write(digest + "\n")

    return log_execution


def stable_worker_id(data_dir: Path, role: str) -> str:
    """A process name kept in ``<data_dir>/<role>-id`` so that a restarted process recognises its own claims.

    Two live processes must not share one: give each worker its own data directory or ``--worker-id``.
    """
    path = data_dir / f"{role}-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        name = f"{role}-{socket.gethostname()}-{secrets.token_hex(4)}"
        path.write_text(name + "\n")
        return name


@dataclass
class Runtime:
    settings: Settings
    store: Store
    ctx: ServiceContext
    residency: Residency
    runner: BatchRunner

    async def close(self) -> None:
        if self.ctx.engine is not None:
            await self.ctx.engine.close()
        await self.store.close()


async def start_runtime(
    settings: Settings,
    *,
    engine_factory: EngineFactory | None = None,
    on_change: Callable[[str], None] | None = None,
    worker_id: str | None = None,
    role: str = "server",
) -> Runtime:
    """Open the store (migrating it; SQLite is locked to this process), load the model, build the runner."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = await Store.open(settings.resolved_database_url(), lock=True)
    factory = engine_factory or load_engine

    def prepare(engine: Engine) -> Engine:
        if settings.execution_log is not None:
            engine.on_execute = execution_logger(settings.execution_log)  # type: ignore[attr-defined]
        return engine

    try:
        engine = prepare(await factory(settings))
    except BaseException:
        await store.close()
        raise
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(settings.seed), store=store)
    residency = Residency(ctx, settings, factory, prepare)
    worker_id = worker_id or stable_worker_id(settings.data_dir, role)
    runner = BatchRunner(store, ctx, settings, on_change=on_change, worker_id=worker_id)
    return Runtime(settings, store, ctx, residency, runner)
