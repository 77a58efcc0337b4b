"""Which scopes a request needs (:func:`needed_scopes`), read from its method and route, in one table.

A key may use only its scopes (:data:`~miserver.protocol.accounts.SCOPES`); authentication refuses a request that needs
another with 403 ``insufficient_scope`` (:func:`check_scopes`), and so do the web console, whose pages need the scopes
of their API twins (``miserver.console.access``), and the Socket.IO ``subscribe``. What changes the model for every
tenant needs ``models:write``: loading and unloading, weight writes, checkpoints, catalogue entries, the model lease,
and a batch created or handed with a lease (``X-miLLM-Lease``). Admin-only routes (keys) are refused to other keys by
their own dependency; a route this table does not name (health, usage, webhooks, the model list's reads) needs no scope.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ...errors import PermissionDeniedError

_CONVERTER = re.compile(r"\{(\w+):\w+\}")

#: ``POST`` routes that run inference on an engine (they are billed, and need ``inference``).
INFERENCE_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/api/probes/score",
        "/anthropic/v1/messages",
    }
)

#: ``(method, route path)`` -> the scope it needs. Route paths are the routes' templates without converters
#: (``{model_id}`` for ``{model_id:path}``).
ROUTE_SCOPES: dict[tuple[str, str], str] = {
    **{("POST", path): "inference" for path in (*INFERENCE_ROUTES, "/anthropic/v1/messages/count_tokens")},
    ("GET", "/v1/responses/{response_id}"): "inference",
    ("DELETE", "/v1/responses/{response_id}"): "inference",
    ("GET", "/v1/responses/{response_id}/input_items"): "inference",
    # probes belong to the key that trains them (they change nothing for other tenants): inference
    ("POST", "/api/probes"): "inference",
    ("GET", "/api/probes"): "inference",
    ("GET", "/api/probes/{name}"): "inference",
    ("DELETE", "/api/probes/{name}"): "inference",
    **{
        (method, path): "files"
        for method, path in (
            ("POST", "/v1/files"),
            ("GET", "/v1/files"),
            ("GET", "/v1/files/{file_id}"),
            ("DELETE", "/v1/files/{file_id}"),
            ("GET", "/v1/files/{file_id}/content"),
            ("GET", "/v1/files/{file_id}/cost_estimate"),
        )
    },
    **{
        (method, path): "batches"
        for method, path in (
            ("POST", "/v1/batches"),
            ("GET", "/v1/batches"),
            ("GET", "/v1/batches/{batch_id}"),
            ("DELETE", "/v1/batches/{batch_id}"),
            ("GET", "/v1/batches/{batch_id}/results"),
            ("POST", "/v1/batches/{batch_id}/cancel"),
            ("POST", "/v1/batches/{batch_id}/pause"),
            ("POST", "/v1/batches/{batch_id}/resume"),
            ("POST", "/v1/batches/{batch_id}/retry"),
            ("POST", "/anthropic/v1/messages/batches"),
            ("GET", "/anthropic/v1/messages/batches"),
            ("GET", "/anthropic/v1/messages/batches/{message_batch_id}"),
            ("DELETE", "/anthropic/v1/messages/batches/{message_batch_id}"),
            ("GET", "/anthropic/v1/messages/batches/{message_batch_id}/results"),
            ("POST", "/anthropic/v1/messages/batches/{message_batch_id}/cancel"),
        )
    },
    **{
        (method, path): "models:write"
        for method, path in (
            ("POST", "/api/models"),
            ("POST", "/api/models/load"),
            ("POST", "/api/models/unload"),
            ("POST", "/api/weights/begin"),
            ("POST", "/api/weights/write"),
            ("POST", "/api/weights/commit"),
            ("POST", "/api/weights/abort"),
            ("POST", "/api/checkpoints"),
            ("DELETE", "/api/checkpoints/{model_id}"),
            ("POST", "/api/lease"),
            ("POST", "/api/lease/{lease}/renew"),
            ("POST", "/api/lease/{lease}/release"),
            ("DELETE", "/api/lease/{lease}"),
            ("POST", "/v1/batches/{batch_id}/lease"),
        )
    },
}

#: Routes that create a batch: with an ``X-miLLM-Lease`` header the batch runs under that lease, which is the model
#: lease's power, so the request needs ``models:write`` too.
LEASED_CREATES = frozenset({("POST", "/v1/batches"), ("POST", "/anthropic/v1/messages/batches")})


def needed_scopes(method: str, route_path: str, headers: Mapping[str, str]) -> tuple[str, ...]:
    """The scopes ``method route_path`` needs (none, one, or two for a batch created with a lease)."""
    key = (method.upper(), _CONVERTER.sub(r"{\1}", route_path))
    scope = ROUTE_SCOPES.get(key)
    needed: tuple[str, ...] = () if scope is None else (scope,)
    if key in LEASED_CREATES and headers.get("x-millm-lease"):
        needed += ("models:write",)
    return needed


def insufficient_scope(scope: str) -> PermissionDeniedError:
    """The refusal of a request that needs ``scope``: 403 ``insufficient_scope`` whose message names it (the API,
    the console and the Socket.IO ``subscribe`` answer with this one message)."""
    return PermissionDeniedError(
        f"This API key lacks the '{scope}' scope that this request needs; an admin can make a key with it "
        f'(POST /api/keys with "scopes", or miserver keys create --scope {scope}).',
        code="insufficient_scope",
    )


def check_scopes(held: Iterable[str], needed: Iterable[str]) -> None:
    """Refuse (:func:`insufficient_scope`, 403) the first of ``needed`` that ``held`` (a caller's scopes, such as
    :attr:`~miserver.services.accounts.keys.Principal.scopes`) lacks; nothing when it holds them all."""
    have = frozenset(held)
    for scope in needed:
        if scope not in have:
            raise insufficient_scope(scope)
