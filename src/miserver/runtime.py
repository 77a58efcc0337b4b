"""The pieces a serving process runs, built in one place for ``miserver serve`` and ``miserver worker``:
the store, the resident engine, its admission gate and lease, the residency manager and the batch runner."""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .batches.runner import BatchRunner
from .clock import now
from .engines.base import Engine, GenerationRequest, PoolRequest
from .engines.upstream import Gateway, KnownUpstream, RetryPolicy, ServedModel, Timeouts, start_gateway
from .jobs.background import BackgroundJobs
from .scheduling.admission import AdmissionGate
from .services.accounts.prices import PriceTable
from .services.inference.context import ServiceContext
from .services.model_life.catalogue import Catalogue, CatalogueEntry, read_catalogue_file
from .services.model_life.checkpoints import Checkpoints
from .services.model_life.residency import Residency
from .services.model_life.weights import WeightWrites
from .settings import EMBEDDED_MODEL_ID, Settings
from .store import Store
from .store import upstreams as store_upstreams

EngineFactory = Callable[[Settings], Awaitable[Engine]]


#: Spins of an idle OpenMP worker before it sleeps (GNU libgomp's ``GOMP_SPINCOUNT``; its default is 300,000).
GOMP_SPINCOUNT = 10_000


async def load_engine(settings: Settings) -> Engine:
    """The resident engine for ``settings.model`` (imported lazily: torch is heavy), its forward passes on
    ``settings.torch_threads`` CPU threads when set."""
    # OpenMP's worker threads (GNU libgomp, as in torch's Linux wheels) spin briefly between parallel regions, then
    # sleep, unless the environment sets a policy: spinning without end (OMP_WAIT_POLICY=ACTIVE) takes a core from
    # the event loop, and sleeping at once (PASSIVE) pays a wake-up for each of a decode step's ~600 regions (a
    # one-row step 26-33 ms against 20 ms here; bench/peers.py). Read once, as OpenMP starts with torch's import.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
    from .engines.local.decoding import DecodeOptions
    from .engines.local.engine import LocalEngine

    return await LocalEngine.start(
        model=settings.model,
        served_model_name=settings.served_model_name,
        cache_dir=settings.cache_dir,
        device=settings.device,
        max_sequences=settings.max_sequences,
        batch_slots=settings.batch_generate_slots,
        prefill_tokens=settings.batch_prefill_tokens,
        batch_hold_steps=settings.batch_hold_steps,
        batch_rows_beside_interactive=settings.batch_rows_beside_interactive,
        threads=settings.torch_threads,
        decode=DecodeOptions(
            settings.decode,
            weights=settings.decode_weights,
            prefill=settings.prefill,
            compile=settings.compile == "on",
            compile_cache=settings.cache_dir / "inductor",
            attention=settings.decode_attention,
            kv_cache=settings.kv_cache,
            kernel_cache=settings.cache_dir / "kernels",
            quantized_rows=settings.decode_quantized_rows,
        ),
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


async def start_upstreams(settings: Settings, store: Store | None = None) -> Gateway | None:
    """The gateway to the upstreams of ``settings.upstreams`` (None when none is configured), probed once.

    With ``store``, discovery is remembered there (``store.upstreams``): the gateway starts from the model lists of
    the last run (an upstream down now keeps its pools, down: its rows wait and synchronous requests get 503) and
    writes each list a probe finds changed.
    """
    timeouts = Timeouts(
        connect=settings.upstream_connect_timeout,
        first_byte=settings.upstream_first_byte_timeout,
        idle=settings.upstream_idle_timeout,
        total=settings.upstream_total_timeout,
    )
    policy = RetryPolicy(max_attempts=settings.upstream_max_attempts, base=settings.upstream_backoff_seconds)
    known: dict[str, KnownUpstream] = {}
    on_models = None
    if store is not None and settings.upstreams:
        async with store.read() as conn:
            stored = await store_upstreams.list_upstreams(conn)
        known = {
            u.name: KnownUpstream(u.base_url, tuple(ServedModel(m.id, m.context_length) for m in u.models))
            for u in stored
        }

        async def remember(name: str, base_url: str, models: list[ServedModel]) -> None:
            async with store.tx() as conn:
                pairs = [(m.id, m.context_length) for m in models]
                await store_upstreams.replace_models(conn, name, base_url, pairs, now())

        on_models = remember
    return await start_gateway(
        [settings.upstreams],
        timeouts,
        policy,
        default_max_in_flight=settings.upstream_max_in_flight,
        health_seconds=settings.upstream_health_seconds,
        known=known,
        on_models=on_models,
    )


@dataclass
class Runtime:
    settings: Settings
    store: Store
    ctx: ServiceContext
    residency: Residency
    runner: BatchRunner
    jobs: BackgroundJobs
    weights: WeightWrites
    checkpoints: Checkpoints
    catalogue: Catalogue

    async def close(self) -> None:
        if self.ctx.gateway is not None:
            await self.ctx.gateway.close()
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
    on_model_loading: Callable[[dict[str, Any]], None] | None = None,
) -> Runtime:
    """Open the store (migrating it; SQLite is locked to this process), load the model, build the runner.

    A bad catalogue file (``MISERVER_CATALOGUE``) stops the start with ``ValueError`` before anything opens.
    ``on_model_loading`` receives the ``model:loading`` progress of later loads.
    """
    catalogue_entries = read_catalogue_file(settings.catalogue) if settings.catalogue is not None else []
    named = next(
        (e for e in catalogue_entries if settings.model == e.id or settings.model.lower() in map(str.lower, e.aliases)),
        None,
    )
    if named is not None:  # --model names a catalogue entry (by id or alias): load its source under its id
        settings = settings.model_copy(
            update={"model": named.source, "served_model_name": settings.served_model_name or named.id}
        )
    prices = PriceTable.load(settings.prices_file)  # a bad price file stops the start before anything opens
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = await Store.open(settings.resolved_database_url(), lock=True)
    factory = engine_factory or load_engine

    def prepare(engine: Engine) -> Engine:
        if settings.execution_log is not None:
            engine.on_execute = execution_logger(settings.execution_log)  # type: ignore[attr-defined]
        return engine

    try:
        engine = None if settings.no_model else prepare(await factory(settings))  # --no-model: a pure gateway
    except BaseException:
        await store.close()
        raise
    ctx = ServiceContext(
        engine=engine,
        # wide: the engine's step scheduler admits each sequence; the gate keeps model-life operations (exclusive)
        # apart from requests and batch chunks
        gate=AdmissionGate(settings.max_sequences + 1),
        rng=random.Random(settings.seed),
        store=store,
        prices=prices,
    )
    ctx.gate.admission_check = ctx.refuse_if_torn  # no request starts while the weights are mid-write
    worker_id = worker_id or stable_worker_id(settings.data_dir, role)
    runner = BatchRunner(store, ctx, settings, on_change=on_change, worker_id=worker_id)
    fixed = [CatalogueEntry(EMBEDDED_MODEL_ID, EMBEDDED_MODEL_ID, (), "embedded"), *catalogue_entries]
    if engine is not None and not any(e.id == engine.info.model_id for e in fixed):
        fixed.append(CatalogueEntry(engine.info.model_id, settings.model, (), "command line"))
    catalogue = Catalogue(ctx, store, fixed)
    weights = WeightWrites(ctx, store, on_change=runner.wake)
    checkpoints = Checkpoints(
        ctx, store, weights, data_dir=settings.data_dir, cache_dir=settings.cache_dir, known_ids=catalogue.ids
    )
    residency = Residency(
        ctx,
        settings,
        factory,
        prepare,
        catalogue=catalogue,
        checkpoints=checkpoints,
        weights=weights,
        on_loading=on_model_loading,
    )
    try:
        await catalogue.refresh()
        await checkpoints.refresh()
        await weights.load_flag()  # a crash mid-write left the resident weights torn: they stay so until restored
        ctx.gateway = await start_upstreams(settings, store)
    except BaseException:
        if engine is not None:
            await engine.close()
        await store.close()
        raise
    return Runtime(
        settings=settings,
        store=store,
        ctx=ctx,
        residency=residency,
        runner=runner,
        jobs=BackgroundJobs(store, settings, worker_id=worker_id),
        weights=weights,
        checkpoints=checkpoints,
        catalogue=catalogue,
    )
