"""Which scopes each console route needs: those of its API twin, the API route that does the same thing
(:data:`TWINS`), read from the API's own table (:func:`~miserver.services.accounts.scopes.needed_scopes`), so the
console and the API cannot disagree about a scope.

:func:`require_scopes` is a dependency of every console page (``create_console`` adds it to the pages' router): a
session whose key lacks a scope gets the same 403 ``insufficient_scope`` as the API, naming it (the console's
error page, or the API's envelope for a script request), before the page reads its form or changes anything. The
session's caller, scopes included, is re-read from its key at every request (``ConsoleState.principal``). A console
route missing from :data:`TWINS` is refused to every key but an admin key (closed by default;
``tests/unit/test_console_scopes.py`` keeps the table whole).
"""

from __future__ import annotations

from fastapi import Request

from ..services.accounts.keys import Principal
from ..services.accounts.scopes import check_scopes, needed_scopes

#: ``(method, console route path)`` -> the API routes ``(method, route path)`` whose scopes it needs (none: the
#: page needs no scope). Paths are relative to ``/console``.
TWINS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    # before a session exists, or ending one
    ("GET", "/signin"): (),
    ("POST", "/signin"): (),
    ("POST", "/signout"): (),
    # the job list, one row of it, cancel
    ("GET", "/"): (("GET", "/v1/batches"),),
    ("GET", "/batches/{batch_id}/row"): (("GET", "/v1/batches/{batch_id}"),),
    ("POST", "/batches/{batch_id}/cancel"): (("POST", "/v1/batches/{batch_id}/cancel"),),
    # a job's detail and its results tab (the input file's name is shown only to a key with ``files``)
    ("GET", "/batches/{batch_id}"): (("GET", "/v1/batches/{batch_id}"), ("GET", "/v1/batches/{batch_id}/results")),
    # downloads of input, success and error files
    ("GET", "/files/{file_id}/content"): (("GET", "/v1/files/{file_id}/content"),),
    # the create page (an upload, then a create), its upload, estimate and create
    ("GET", "/batches/new"): (("POST", "/v1/batches"), ("POST", "/v1/files")),
    ("POST", "/upload"): (("POST", "/v1/files"),),
    ("GET", "/files/{file_id}/estimate"): (("GET", "/v1/files/{file_id}/cost_estimate"),),
    ("POST", "/batches"): (("POST", "/v1/batches"),),
    # a key's own usage (an admin's key filter: its admin flag, as for the API)
    ("GET", "/usage"): (("GET", "/api/usage"),),
    ("GET", "/usage.csv"): (("GET", "/api/usage"),),
    # a member's own key (every key for an admin key: its admin flag, as ``GET /api/keys`` needs)
    ("GET", "/keys"): (("GET", "/api/account"),),
}

#: What a console route missing from :data:`TWINS` needs: an admin key.
UNLISTED = ("admin",)


def console_scopes(method: str, route_path: str) -> tuple[str, ...]:
    """The scopes the console route ``method route_path`` needs, in order and without repeats: the union of its
    twins' scopes; :data:`UNLISTED` for a route without an entry. ``HEAD`` is read as ``GET``."""
    method = "GET" if method.upper() == "HEAD" else method.upper()
    twins = TWINS.get((method, route_path))
    if twins is None:
        return UNLISTED
    needed: list[str] = []
    for twin_method, twin_path in twins:
        needed += [s for s in needed_scopes(twin_method, twin_path, {}) if s not in needed]
    return tuple(needed)


def may(principal: Principal | None, method: str, route_path: str) -> bool:
    """Whether ``principal`` holds every scope the console route needs (the navigation hides the others)."""
    return principal is not None and all(s in principal.scopes for s in console_scopes(method, route_path))


async def require_scopes(request: Request) -> None:
    """The dependency of every console page: 403 ``insufficient_scope`` naming the first scope that the session's
    key lacks among those the route needs (:func:`console_scopes`). Sign-in, which runs without a session, needs
    none."""
    route = request.scope.get("route")
    needed = console_scopes(request.method, str(getattr(route, "path", request.url.path)))
    if not needed:
        return
    principal = getattr(request.state, "principal", None)
    check_scopes(principal.scopes if isinstance(principal, Principal) else (), needed)
