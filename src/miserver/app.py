"""``create_app(settings)``: the FastAPI application. Its lifespan opens the store, loads the resident model,
builds the admission gate and starts the batch runner; on shutdown the runner finishes its current row first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .api import accounts as accounts_api
from .api import anthropic as anthropic_api
from .api import batches as batches_api
from .api import embeddings as embeddings_api
from .api import files as files_api
from .api import health as health_api
from .api import inference as inference_api
from .api import model_lease as leases_api
from .api import model_life as model_life_api
from .api import models as models_api
from .api import operations as operations_api
from .api import probes as probes_api
from .api import responses as responses_api
from .api.common import AppState
from .api.openapi import install_openapi
from .client_gone import CancelOnDisconnect
from .clock import now
from .console import ConsoleRoot, create_console
from .errors import SERVER_ERROR_MESSAGE, APIError, InvalidRequestError, NotFoundError, ServerError
from .events import ProgressEvents
from .ids import random_id
from .metrics import INTERACTIVE_ROUTES, Metrics
from .protocol.common import param_path
from .runtime import EngineFactory, start_runtime
from .services.accounts import keys as accounts
from .settings import Settings

log = logging.getLogger("miserver")


def _error_response(exc: APIError, path: str = "") -> JSONResponse:
    status, body = exc.answer_for(path)  # Anthropic's envelope under /anthropic/, OpenAI's elsewhere
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


class ServerErrors:
    """ASGI middleware: an unhandled exception becomes the OpenAI 500 envelope, sent as an ordinary response, and
    never costs the client its keep-alive connection.

    Starlette's own last-resort handler (the console's, a mounted application, has one too) sends its 500 and then
    re-raises, and uvicorn answers a re-raised exception by closing the connection: the client's next request on
    that connection would fail. Here the exception ends with the response: before anything was sent, the 500
    envelope is sent; after a whole response was sent, the exception is logged and goes no further. Only a response
    cut short (a stream that started and failed) lets the exception go on, since nothing can end that response.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def watch(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if ended:
                log.error("unhandled error after the response was sent", exc_info=exc)
                return
            if started:
                raise
            log.exception("unhandled error", exc_info=exc)
            await _error_response(ServerError(SERVER_ERROR_MESSAGE), scope.get("path", ""))(scope, receive, send)


class RequestIds:
    """ASGI middleware (outermost): every HTTP response carries ``x-request-id``, the caller's own or a new
    ``req_...``, and the time to its start is observed as interactive latency (``/metrics``, inference routes only).
    A plain ASGI wrapper: Starlette's ``BaseHTTPMiddleware`` costs a task and two memory streams per request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get("x-request-id") or random_id("req_")
        path = scope.get("path", "")
        started = time.perf_counter()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.observe(path, time.perf_counter() - started)
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        await self.app(scope, receive, with_id)


class TrailingSlash:
    """ASGI middleware: ``/v1/files/`` is routed as ``/v1/files`` (no route of miServer ends with a slash), so a
    trailing slash answers exactly what the route answers, never a redirect that would drop a POST body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
            raw = scope.get("raw_path")
            if isinstance(raw, bytes) and raw.endswith(b"/"):
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> FastAPI:
    """Build the HTTP application. ``engine_factory(settings)`` may replace model loading (tests).

    ``app.state.events`` is the Socket.IO server; :func:`create_asgi` wraps the app so that it serves
    ``/socket.io`` too.
    """
    settings = settings or Settings()
    events = ProgressEvents(poll_seconds=settings.batch_poll_seconds)
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await start_runtime(
            settings, engine_factory=engine_factory, on_change=events.notify, on_model_loading=events.model_loading
        )
        try:
            await accounts.refuse_open_exposure(runtime.store, settings.host, settings.insecure_no_auth)
        except BaseException:
            await runtime.close()
            raise
        events.bind(runtime.store)
        app.state.miserver = AppState(
            settings=settings,
            store=runtime.store,
            ctx=runtime.ctx,
            runner=runtime.runner,
            jobs=runtime.jobs,
            residency=runtime.residency,
            started_at=now(),
        )
        task = asyncio.create_task(runtime.runner.run(), name="miserver-batch-runner")
        runtime.jobs.start()  # file pruning and webhook delivery, beside the runner
        events.start()
        sampler = asyncio.create_task(metrics.sample_busy(lambda: runtime.ctx.gate), name="miserver-metrics-sampler")
        engine = runtime.ctx.engine
        model_id = engine.info.model_id if engine else "none (--no-model)"
        if engine is None and runtime.ctx.gateway is None:
            log.warning("no resident model and no usable upstream: nothing can be served (see --upstream)")
        log.info("miServer ready: model %s, database %s", model_id, runtime.store.url.split(":")[0])
        try:
            yield
        finally:
            runtime.runner.stop()
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await runtime.jobs.stop()
            await events.stop()
            await runtime.close()

    app = FastAPI(
        title="miServer",
        version="0.1.0",
        lifespan=lifespan,
        redirect_slashes=False,
        docs_url=None,  # the offline /docs of install_openapi replaces FastAPI's CDN page
        redoc_url=None,  # ReDoc loads its script and fonts from a CDN: turned off
    )
    # every route needs an API key once one exists (services/accounts/keys.py); with none the server stays open
    app.router.dependencies.append(Depends(accounts.authenticate))
    app.add_middleware(ServerErrors)  # innermost: the 500 still gets x-request-id
    # an inference request whose client has gone is cancelled before it has answered (client_gone.py)
    app.add_middleware(CancelOnDisconnect, paths=INTERACTIVE_ROUTES)
    # gzip for clients that ask (Accept-Encoding); Server-Sent Events are never compressed
    app.add_middleware(GZipMiddleware, minimum_size=1024)
    app.add_middleware(ConsoleRoot)  # /console (and /console/, after TrailingSlash) -> the console's job list
    app.add_middleware(TrailingSlash)
    app.add_middleware(RequestIds, metrics=metrics)  # outermost: every response, errors too, has x-request-id

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = tuple(p for p in err.get("loc", ()) if p not in ("query", "path", "body", "header"))
        param = param_path(loc) or None
        message = f"Invalid '{param}': {err.get('msg', 'invalid value')}."
        return _error_response(InvalidRequestError(message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            return _error_response(NotFoundError("Unknown route.", code="unknown_url"), path)
        if exc.status_code == 405:
            refused = InvalidRequestError("Method not allowed for this route.", code="method_not_allowed")
            return JSONResponse(refused.answer_for(path)[1], status_code=405)
        other = APIError(str(exc.detail))
        return JSONResponse(other.answer_for(path)[1], status_code=exc.status_code)

    for module in (inference_api, models_api, files_api, batches_api, leases_api, health_api):
        app.include_router(module.router)
    app.include_router(embeddings_api.router)
    app.include_router(probes_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(operations_api.router)
    app.include_router(model_life_api.router)
    app.include_router(accounts_api.router)
    console = create_console(app)  # the web console: its own session-cookie sign-in, not in the schema
    app.mount("/console", console)
    events.cookie_principal = console.state.console.from_cookie_header
    install_openapi(app)  # /openapi.json (built at its first request, from every route) and the offline /docs
    app.state.events = events
    app.state.metrics = metrics
    return app


def create_asgi(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> Any:
    """The application with Socket.IO mounted at ``/socket.io`` (what ``miserver serve`` runs)."""
    app = create_app(settings, engine_factory=engine_factory)
    return app.state.events.asgi(app)
