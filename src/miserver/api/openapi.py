"""The OpenAPI document (``GET /openapi.json``) and its offline viewer (``GET /docs``).

The routes read raw JSON bodies (strict mode must see unknown fields), so FastAPI cannot infer what they accept or
answer. Each route says it with one decorator, :func:`documented`, naming the pydantic models of ``protocol/`` that
validate its body and build its answers::

    @router.post("/v1/chat/completions")
    @documented(body=ChatCompletionRequest, ok=ChatCompletion, stream=ChatCompletionChunk, errors=INFERENCE_ERRORS)
    async def chat_completions(request: Request) -> Response: ...

:func:`openapi_document` then writes, for every operation, its ``requestBody`` (JSON or multipart), its success
response and one response per error status in the envelope of its path (OpenAI's, or Anthropic's under
``/anthropic/``), with the models' JSON Schemas (request models in validation mode, answers in serialization mode)
under ``components/schemas``. A route without the decorator is a mistake that ``tests/unit/test_openapi.py`` finds.

``/docs`` is Swagger UI served from files inside the package (``api/static/swagger-ui/``, see ``VENDORED.md``
there): the page makes no request to another host. FastAPI's ReDoc page (``/redoc``) is turned off: it loads its
script and fonts from a CDN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, routing
from fastapi.dependencies.models import Dependant
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ..errors import ANTHROPIC_PREFIX
from ..protocol.errors import AnthropicErrorResponse, ErrorResponse
from ..services.accounts.keys import BILLED_ROUTES, is_open, require_admin
from ..services.accounts.scopes import needed_scopes

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute :func:`documented` sets on a route's endpoint function.
ATTRIBUTE = "__miserver_openapi__"
#: Where the vendored Swagger UI files are served.
STATIC_PREFIX = "/docs/static"
#: The vendored files that ``/docs`` loads, with their media types.
STATIC_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}

#: Why a status is answered (the description of each documented error response).
ERROR_MEANINGS = {
    400: "Invalid request: the envelope's `param` names the field and `code` the reason.",
    401: "API keys exist and the request carries none, or an unknown or revoked one.",
    402: "The API key's balance is used up (inference routes).",
    403: "The key may not do this (an admin route).",
    404: "No such object (file, batch, model, probe, response, lease) or route.",
    409: "Conflict with the object's state (a batch that ended, a file in use, a lease held by another).",
    413: "Too large: the message names the limit and the measured value.",
    429: "Too many requests or tokens.",
    500: "A fault of the server (never a client's mistake).",
    503: "The engine cannot take the request now (no resident model, loading, shutting down).",
    529: "Anthropic's 'overloaded' status (what 503 is on the `/anthropic/` routes).",
}

#: Errors of every route: a bad request (unparseable JSON, a bad query value) and a fault of the server.
BASE_ERRORS: tuple[int, ...] = (400, 500)
#: Errors of the inference routes (model not found, lease conflicts, no resident model).
INFERENCE_ERRORS: tuple[int, ...] = (400, 404, 409, 500, 503)
#: Errors of a route that reads one object by id.
LOOKUP_ERRORS: tuple[int, ...] = (400, 404, 500)
#: Errors of a route that changes one object by id (which may be in the wrong state).
CHANGE_ERRORS: tuple[int, ...] = (400, 404, 409, 500)

#: The request headers a route may read, documented as header parameters.
HEADERS: dict[str, tuple[str, str]] = {
    "strict": (
        "X-miLLM-Strict",
        "`true` refuses unknown fields with 400 `unknown_parameter` (default: ignored). `true`/`false`, `1`/`0` or "
        "`yes`/`no` in any case; any other value is 400 `invalid_value`.",
    ),
    "lease": ("X-miLLM-Lease", "A live model lease: the request runs under it (needed while a holder has one)."),
    "idempotency": ("Idempotency-Key", "A retry under the same key gets the first answer again."),
    "invariant": (
        "X-miLLM-Batch-Invariant",
        "`true` runs the request alone at every decode step of the resident model, so its result never depends on "
        "what else runs (bit for bit, as a `pack: false` batch row); default `false`: it shares forward passes. "
        "Values as `X-miLLM-Strict`.",
    ),
}

Header = Literal["strict", "lease", "idempotency", "invariant"]


@dataclass(frozen=True)
class Documentation:
    """What one route takes and answers (set by :func:`documented`).

    ``body``: the model of the JSON request body (None: the route reads no body); ``form``: the model of a
    ``multipart/form-data`` body instead; ``body_required``: whether the body may be left out; ``ok``: the model of
    the 200 JSON answer; ``ok_media``: the answer's media type when it is not JSON (a file's bytes), with ``ok``
    None; ``stream``: whether the route answers Server-Sent Events when the body asks for a stream, or the model of each
    event's data; ``errors``: the error
    statuses the route answers; ``headers``: the request headers it reads.
    """

    body: type[BaseModel] | None = None
    form: type[BaseModel] | None = None
    body_required: bool = True
    ok: type[BaseModel] | None = None
    ok_media: str | None = None
    stream: type[BaseModel] | bool = False
    errors: tuple[int, ...] = BASE_ERRORS
    headers: tuple[Header, ...] = ()
    lines: type[BaseModel] | None = None


def documented(
    *,
    body: type[BaseModel] | None = None,
    form: type[BaseModel] | None = None,
    body_required: bool = True,
    ok: type[BaseModel] | None = None,
    ok_media: str | None = None,
    stream: type[BaseModel] | bool = False,
    errors: Iterable[int] = BASE_ERRORS,
    headers: Iterable[Header] = (),
    lines: type[BaseModel] | None = None,
) -> Callable[[F], F]:
    """Decorator (under the ``@router.<method>`` line) recording what the route takes and answers for the OpenAPI
    document; see :class:`Documentation` for the arguments. It changes nothing in how the route runs.

    Raises ``ValueError`` for an error status without a meaning in :data:`ERROR_MEANINGS`, or when both ``ok`` and
    ``ok_media`` (or both ``body`` and ``form``) are given.
    """
    # a JSON body over MISERVER_MAX_REQUEST_BYTES (or a route's own limit) is a 413 on every route that reads one
    statuses = tuple(sorted(set(errors) | ({413} if body is not None else set())))
    unknown = [s for s in statuses if s not in ERROR_MEANINGS]
    if unknown:
        raise ValueError(f"no meaning for error statuses {unknown}: add them to ERROR_MEANINGS")
    if ok is not None and ok_media is not None:
        raise ValueError("a route answers either a JSON model (ok) or another media type (ok_media)")
    if body is not None and form is not None:
        raise ValueError("a route reads either a JSON body or a form")
    doc = Documentation(body, form, body_required, ok, ok_media, stream, statuses, tuple(headers), lines)

    def mark(endpoint: F) -> F:
        setattr(endpoint, ATTRIBUTE, doc)
        return endpoint

    return mark


@dataclass(frozen=True)
class Operation:
    """One routed endpoint of the application: its path (as the document writes it), methods, documentation
    (None when its endpoint was not decorated with :func:`documented`) and whether it is for admin keys only (it
    depends on ``services/accounts.require_admin``, directly or through its router: 403 for other keys)."""

    path: str
    methods: frozenset[str]
    documentation: Documentation | None
    admin: bool = False


def _needs_admin(dependant: Dependant) -> bool:
    """Whether ``require_admin`` is among the dependencies of a route (at any depth)."""
    stack = [dependant]
    while stack:
        node = stack.pop()
        if node.call is require_admin:
            return True
        stack.extend(node.dependencies)
    return False


def operations(app: FastAPI) -> list[Operation]:
    """Every API route of ``app`` that the document includes (routers included in routers too)."""
    found = []
    for context in routing.iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and route.include_in_schema:
            doc = getattr(route.endpoint, ATTRIBUTE, None)
            path = getattr(context, "path_format", route.path_format)
            documentation = doc if isinstance(doc, Documentation) else None
            methods = set(getattr(context, "methods", None) or route.methods or ())
            found.append(Operation(path, frozenset(methods), documentation, _needs_admin(route.dependant)))
    return found


def _is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIX)


def _models(routes: list[tuple[str, Documentation]]) -> list[tuple[type[BaseModel], Any]]:
    """Every model the document needs, each once, with its JSON Schema mode."""
    wanted: dict[tuple[type[BaseModel], str], None] = {(ErrorResponse, "serialization"): None}
    for path, doc in routes:
        for model in (doc.body, doc.form):
            if model is not None:
                wanted[(model, "validation")] = None
        if doc.lines is not None:
            wanted[(doc.lines, "validation" if doc.form is not None else "serialization")] = None
        for answer in (doc.ok, doc.stream):
            if isinstance(answer, type):
                wanted[(answer, "serialization")] = None
        if _is_anthropic(path):
            wanted[(AnthropicErrorResponse, "serialization")] = None
    return list(wanted)


def _auth_errors(method: str, path: str, admin: bool) -> tuple[int, ...]:
    """What authentication adds to a route's errors (``services/accounts.authenticate``): 401 on every route but the
    open ones, 402 on the inference routes, 403 on the admin-only ones (``require_admin``) and on those that need a
    scope (``insufficient_scope``, :data:`~miserver.services.accounts.scopes.ROUTE_SCOPES`)."""
    if is_open(method, path):
        return ()
    billed = (402,) if method.upper() == "POST" and path in BILLED_ROUTES else ()
    refused = admin or needed_scopes(method, path, {}) != ()
    return (401, *billed, *((403,) if refused else ()))


def _operation(
    method: str, op: Operation, doc: Documentation, operation: dict[str, Any], refs: Mapping[Any, Any]
) -> None:
    """Fill one operation of the document from its route's :class:`Documentation` (in place)."""
    path = op.path

    def ref(model: type[BaseModel], mode: str) -> dict[str, Any]:
        return dict(refs[(model, mode)])

    if doc.body is not None:
        operation["requestBody"] = {
            "required": doc.body_required,
            "content": {"application/json": {"schema": ref(doc.body, "validation")}},
        }
    elif doc.form is not None:
        form: dict[str, Any] = {"schema": ref(doc.form, "validation")}
        if doc.lines is not None:
            form["x-jsonl-line-schema"] = ref(doc.lines, "validation")
        operation["requestBody"] = {"required": doc.body_required, "content": {"multipart/form-data": form}}
    ok: dict[str, Any] = {}
    if doc.ok is not None:
        ok["application/json"] = {"schema": ref(doc.ok, "serialization")}
    if doc.ok_media is not None:
        ok[doc.ok_media] = {"schema": {"type": "string", "format": "binary"}}
        if doc.lines is not None:
            ok[doc.ok_media]["x-jsonl-line-schema"] = ref(doc.lines, "serialization")
    if isinstance(doc.stream, type):
        event = ref(doc.stream, "serialization")
        ok["text/event-stream"] = {
            "schema": {"type": "string", "description": f"Server-Sent Events; each event's data is {event['$ref']}"},
            "x-event-schema": event,
        }
    elif doc.stream:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "Server-Sent Events."}}
    success: dict[str, Any] = {"description": "Success."}
    if ok:
        success["content"] = ok
    envelope = AnthropicErrorResponse if _is_anthropic(path) else ErrorResponse
    responses: dict[str, Any] = {"200": success}
    for status in sorted({*doc.errors, *_auth_errors(method, path, op.admin)}):
        responses[str(status)] = {
            "description": ERROR_MEANINGS[status],
            "content": {"application/json": {"schema": ref(envelope, "serialization")}},
        }
    operation["responses"] = responses
    parameters = operation.setdefault("parameters", [])
    for key in doc.headers:
        name, meaning = HEADERS[key]
        parameters.append(
            {"name": name, "in": "header", "required": False, "description": meaning, "schema": {"type": "string"}}
        )
    if not parameters:
        del operation["parameters"]


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The application's OpenAPI 3.1 document (built once, then cached on ``app.openapi_schema``).

    FastAPI's own document gives the paths, path and query parameters; every route decorated with
    :func:`documented` gets its request body, success response and error responses from the protocol models. The
    422 responses FastAPI would add are dropped: this server answers a bad parameter with 400 in its error envelope.
    """
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    found = [op for op in operations(app) if op.documentation is not None]
    routes = [(op.path, op.documentation) for op in found if op.documentation is not None]
    refs, defs = models_json_schema(_models(routes), ref_template="#/components/schemas/{model}")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(defs.get("$defs", {}))
    for op in found:
        assert op.documentation is not None
        for method in op.methods:
            operation = document["paths"].get(op.path, {}).get(method.lower())
            if operation is not None:
                _operation(method, op, op.documentation, operation, refs)
    for item in document["paths"].values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    app.openapi_schema = document
    return document


def _static(name: str) -> bytes:
    return resources.files("miserver.api").joinpath("static", "swagger-ui", name).read_bytes()


def install_openapi(app: FastAPI) -> None:
    """Give ``app`` the document of :func:`openapi_document` and the offline ``/docs`` page with its assets.

    Create the app with ``docs_url=None, redoc_url=None`` (FastAPI's pages load from a CDN).
    """
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_PREFIX}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
    for name, media in STATIC_FILES.items():
        app.add_api_route(
            f"{STATIC_PREFIX}/{name}", _static_route(name, media), methods=["GET"], include_in_schema=False
        )


def _static_route(name: str, media: str) -> Callable[[], Any]:
    async def serve() -> Response:
        return Response(_static(name), media_type=media, headers={"Cache-Control": "public, max-age=86400"})

    return serve
