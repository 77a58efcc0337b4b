"""``create_app(settings)``: the FastAPI application. Its lifespan opens the store, loads the resident model,
builds the admission gate and starts the batch runner; on shutdown the runner finishes its current row first."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import batches as batches_api
from .api import files as files_api
from .api import health as health_api
from .api import inference as inference_api
from .api import models as models_api
from .api.common import AppState
from .batches.runner import BatchRunner
from .engines.base import Engine, GenerationRequest
from .errors import APIError, InvalidRequestError, NotFoundError, ServerError
from .ids import now, random_id
from .protocol.common import param_path
from .scheduler import AdmissionGate
from .services.context import ServiceContext
from .settings import Settings
from .store import Store

log = logging.getLogger("miserver")

EngineFactory = Callable[[Settings], "asyncio.Future[Engine] | Any"]


async def load_engine(settings: Settings) -> Engine:
    """The resident engine for ``settings.model`` (imported lazily: torch is heavy)."""
    from .engines.local.engine import LocalEngine

    return await LocalEngine.start(
        model=settings.model,
        served_model_name=settings.served_model_name,
        cache_dir=settings.cache_dir,
        device=settings.device,
    )


def _execution_logger(path: Path) -> Callable[[GenerationRequest], None]:
    """An ``on_execute`` hook appending ``sha256(prompt ids)`` per engine execution to ``path`` (flushed at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log_execution(request: GenerationRequest) -> None:
        digest = hashlib.sha256(",".join(map(str, request.prompt_ids)).encode()).hexdigest()[:16]
        with path.open("a") as fh:
            fh.write(digest + "\n")

    return log_execution


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status_code)


def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> FastAPI:
    """Build the application. ``engine_factory(settings)`` may replace model loading (tests)."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = await Store.open(settings.resolved_database_url())
        engine = await (engine_factory or load_engine)(settings)
        if settings.execution_log is not None:
            engine.on_execute = _execution_logger(settings.execution_log)  # type: ignore[attr-defined]
        ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(settings.seed))
        runner = BatchRunner(store, ctx, settings)
        app.state.miserver = AppState(settings=settings, store=store, ctx=ctx, runner=runner, started_at=now())
        task = asyncio.create_task(runner.run(), name="miserver-batch-runner")
        log.info("miServer ready: model %s, database %s", engine.info.model_id, "sqlite" if store.is_sqlite else "postgresql")
        try:
            yield
        finally:
            runner.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await engine.close()
            await store.close()

    app = FastAPI(title="miServer", version="0.1.0", lifespan=lifespan)

    @app.middleware("http")
    async def request_id(request: Request, call_next: Callable[[Request], Any]) -> Response:
        rid = request.headers.get("x-request-id") or random_id("req_")
        response: Response = await call_next(request)
        response.headers["x-request-id"] = rid
        return response

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = tuple(p for p in err.get("loc", ()) if p not in ("query", "path", "body", "header"))
        param = param_path(loc) or None
        return _error_response(InvalidRequestError(f"Invalid '{param}': {err.get('msg', 'invalid value')}.", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(NotFoundError("Unknown route.", code="unknown_url"))
        if exc.status_code == 405:
            e = InvalidRequestError("Method not allowed for this route.", code="method_not_allowed")
            return JSONResponse(e.envelope(), status_code=405)
        e = APIError(str(exc.detail))
        return JSONResponse(e.envelope(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error_response(ServerError("The server had an error while processing your request."))

    for module in (inference_api, models_api, files_api, batches_api, health_api):
        app.include_router(module.router)
    return app
