"""Helpers shared by the routes: the typed application state, JSON bodies, service results as responses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import InvalidRequestError, PayloadTooLargeError
from ..http_headers import header_values
from ..jobs.background import BackgroundJobs
from ..model_lease import is_token
from ..services.inference.checks import decode_json
from ..services.inference.context import ServiceContext, ServiceResult, StreamResult
from ..services.model_life.residency import Residency
from ..settings import Settings
from ..store import Store


class RunnerHandle(Protocol):
    """What the routes need of the batch runner (``batches.runner.BatchRunner``): a nudge to look at the batches
    now (after a create, a cancel, a lease handed over, a model loaded) instead of at its next poll."""

    def wake(self) -> None:
        """Make the runner step soon; returns at once."""
        ...


@dataclass
class AppState:
    """Everything the routes reach through ``request.app.state.miserver``: settings, the store (units of work
    only: routes call services, services call the store), the services' context, the runner handle, the background
    jobs, the model residency manager, and the start time (Unix seconds)."""

    settings: Settings
    store: Store
    ctx: ServiceContext
    runner: RunnerHandle
    jobs: BackgroundJobs
    residency: Residency
    started_at: int = 0


def state(request: Request) -> AppState:
    """The application's :class:`AppState` (set by the lifespan of ``create_app``)."""
    st = request.app.state.miserver
    assert isinstance(st, AppState), "the application state is set by create_app's lifespan"
    return st


#: A refused body's bytes are read and dropped, up to this many times the limit, so that a client that sends its
#: whole body before it reads the answer gets the 413 (past that, the connection closes under it).
DISCARD_FACTOR = 64


async def _discard(stream: AsyncIterator[bytes], budget: int) -> None:
    """Read and drop what is left of the body ``stream``, at most ``budget`` bytes (nothing is kept)."""
    async for chunk in stream:
        budget -= len(chunk)
        if budget <= 0:
            return


async def json_body(request: Request, limit: int | None = None, setting: str = "MISERVER_MAX_REQUEST_BYTES") -> Any:
    """The decoded JSON body (any JSON value); 400 ``invalid_json`` when it does not parse; 413
    ``request_too_large`` for a body over ``limit`` bytes (see :func:`bounded_body`)."""
    return decode_json(await bounded_body(request, limit, setting))


async def bounded_body(
    request: Request, limit: int | None = None, setting: str = "MISERVER_MAX_REQUEST_BYTES"
) -> bytes:
    """The request's body, at most ``limit`` bytes (default: the settings' ``max_request_bytes``), or 413
    ``request_too_large`` naming ``setting``, before the body is kept whole: at once when its ``Content-Length``
    says it is larger, else as soon as the bytes received pass the limit (the rest is read and dropped, see
    ``DISCARD_FACTOR``)."""
    if limit is None:
        limit = state(request).settings.max_request_bytes

    def too_large(size: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"The request body is {size} bytes; the limit is {limit} bytes ({setting}).",
            code="request_too_large",
        )

    declared = request.headers.get("content-length", "")
    stream = request.stream()  # one iterator: Starlette refuses a second one
    if declared.isdigit() and int(declared) > limit:
        await _discard(stream, DISCARD_FACTOR * limit)
        raise too_large(declared)
    parts: list[bytes] = []
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > limit:
            await _discard(stream, DISCARD_FACTOR * limit)
            raise too_large(f"more than {limit}")
        parts.append(chunk)
    body = b"".join(parts)
    request._body = body  # as Request.body() keeps it: a later read of the body gets the same bytes
    return body


#: The values of a true/false header (``X-miLLM-Strict``, ``X-miLLM-Batch-Invariant``) that miServer understands
#: (compared case-insensitively), and what each means.
STRICT_VALUES: dict[str, bool] = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def strict_mode(request: Request) -> bool:
    """``X-miLLM-Strict: true`` turns unknown fields into 400 ``unknown_parameter``.

    The header takes ``true``/``false``, ``1``/``0`` or ``yes``/``no`` in any case; absent or empty, the request is
    not strict. Any other value is 400 ``invalid_value`` (param ``X-miLLM-Strict``), never read as "not strict".
    """
    return bool_header(request, "X-miLLM-Strict")


def batch_invariant(request: Request) -> bool:
    """``X-miLLM-Batch-Invariant: true`` runs the request alone at every decode step of the resident engine, so its
    result never depends on what else runs (as a ``pack: false`` batch row). Values as :func:`strict_mode`."""
    return bool_header(request, "X-miLLM-Batch-Invariant")


def bool_header(request: Request, name: str) -> bool:
    """A true/false header (``true``/``false``, ``1``/``0``, ``yes``/``no`` in any case; absent or empty: false).
    Raises 400 ``invalid_value`` naming the header for any other value."""
    value = request.headers.get(name.lower(), "").strip().lower()
    if not value:
        return False
    if value not in STRICT_VALUES:
        raise InvalidRequestError(
            f"Invalid '{name}' header: use true or false (1/0 and yes/no are accepted too).",
            param=name,
        )
    return STRICT_VALUES[value]


def lease_header(request: Request) -> str | None:
    """The lease token sent in ``X-miLLM-Lease``; None when the header is absent or empty.

    A value that is not a lease token (``lease_`` and 24 hex digits, as ``POST /api/lease`` hands out) is 400
    ``invalid_value`` (param ``X-miLLM-Lease``), never run as if it were a lease. Whether the lease is live is for
    the route to decide. The value is not echoed: a lease token lets its holder renew and release the lease.
    """
    value = request.headers.get("x-millm-lease", "").strip()
    if not value:
        return None
    if not is_token(value):
        raise InvalidRequestError(
            "Invalid 'X-miLLM-Lease' header: not a lease token (send the 'lease' that POST /api/lease answered).",
            param="X-miLLM-Lease",
        )
    return value


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The OpenAI list envelope; ``has_more`` is never true on an empty page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more and bool(data),
    }


def to_response(result: ServiceResult | StreamResult) -> Response:
    """A service's result as an HTTP response (JSON, or Server-Sent Events for a stream)."""
    if isinstance(result, StreamResult):

        async def sse() -> AsyncIterator[str]:
            async for payload in result.events:
                yield f"data: {payload}\n\n"

        return StreamingResponse(
            sse(),
            media_type="text/event-stream",
            headers={**header_values(result.headers), "Cache-Control": "no-cache"},
        )
    return JSONResponse(result.body, status_code=result.status_code, headers=header_values(result.headers))
