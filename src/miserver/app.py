"""``create_app(settings)``: the FastAPI application. Its lifespan opens the store, loads the resident model,
builds the admission gate and starts the batch runner; on shutdown the runner finishes its current row first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import batches as batches_api
from .api import embeddings as embeddings_api
from .api import files as files_api
from .api import health as health_api
from .api import inference as inference_api
from .api import models as models_api
from .api import leases as leases_api
from .api import probes as probes_api
from .api.common import AppState
from .errors import SERVER_ERROR_MESSAGE, APIError, InvalidRequestError, NotFoundError, ServerError
from .ids import now, random_id
from .protocol.common import param_path
from .events import ProgressEvents
from .runtime import EngineFactory, start_runtime
from .settings import Settings

log = logging.getLogger("miserver")


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status_code)


def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> FastAPI:
    """Build the HTTP application. ``engine_factory(settings)`` may replace model loading (tests).

    ``app.state.events`` is the Socket.IO server; :func:`create_asgi` wraps the app so that it serves
    ``/socket.io`` too.
    """
    settings = settings or Settings()
    events = ProgressEvents(poll_seconds=settings.batch_poll_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await start_runtime(settings, engine_factory=engine_factory, on_change=events.notify)
        events.bind(runtime.store)
        app.state.miserver = AppState(
            settings=settings,
            store=runtime.store,
            ctx=runtime.ctx,
            runner=runtime.runner,
            residency=runtime.residency,
            started_at=now(),
        )
        task = asyncio.create_task(runtime.runner.run(), name="miserver-batch-runner")
        events.start()
        engine = runtime.ctx.engine
        model_id = engine.info.model_id if engine else None
        log.info("miServer ready: model %s, database %s", model_id, runtime.store.url.split(":")[0])
        try:
            yield
        finally:
            runtime.runner.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await events.stop()
            await runtime.close()

    app = FastAPI(title="miServer", version="0.1.0", lifespan=lifespan)
    # gzip for clients that ask (Accept-Encoding); Server-Sent Events are never compressed
    app.add_middleware(GZipMiddleware, minimum_size=1024)

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
        return _error_response(ServerError(SERVER_ERROR_MESSAGE))

    for module in (inference_api, models_api, files_api, batches_api, leases_api, health_api):
        app.include_router(module.router)
    app.include_router(embeddings_api.router)
    app.include_router(probes_api.router)
    app.state.events = events
    return app


def create_asgi(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> Any:
    """The application with Socket.IO mounted at ``/socket.io`` (what ``miserver serve`` runs)."""
    app = create_app(settings, engine_factory=engine_factory)
    return app.state.events.asgi(app)
