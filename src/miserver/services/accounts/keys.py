"""API keys and who is calling: key making and hashing, the caller (:class:`Principal`), and the one FastAPI
dependency that authenticates every route (:func:`authenticate`), plus :func:`require_admin` for admin-only routes.

A key is ``sk-`` + 32 random bytes in base64url (43 characters); only its SHA-256 hex digest and a display prefix
are stored, and a key is never logged. With no key in the database the server is open (every caller acts as the
anonymous admin, as before keys existed); once one key exists, every route needs one (``Authorization: Bearer``;
``x-api-key`` also on the ``/anthropic`` routes), except ``GET /api/health`` (the liveness probe) and the API's
documentation (``GET /openapi.json``, ``GET /docs`` and its files): :data:`OPEN_ROUTES`.

The caller is kept in a context variable for the request (:func:`current`): services read it to stamp and filter
owners, and the batch runner sets it to a batch's owner while it validates or runs that batch (:func:`acting_as`), so
that a row reaches only what its owner may reach. Outside any request the caller is :data:`SYSTEM` (sees all).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import ipaddress
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request

from ...clock import now
from ...errors import (
    AuthenticationError,
    ConflictError,
    InsufficientQuotaError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from ...ids import ordered_id
from ...model_lease import Lease, shown_holder
from ...protocol.accounts import MEMBER_DEFAULT_SCOPES, SCOPES, KeyCreateRequest, KeyObject, TopUpRequest
from ...protocol.parsing import parse_request
from ...store import Store
from ...store import keys as store_keys
from ...store.keys import KeyRecord
from .scopes import INFERENCE_ROUTES, check_scopes, needed_scopes

#: Characters of a key shown in lists (``sk-`` and the first 8 of the random part).
PREFIX_CHARS = 11
#: Routes open to anyone even when keys exist: the liveness probe, and the documentation of the API (its schema and
#: the ``/docs`` page that shows it, which a browser opens without a key).
OPEN_ROUTES = frozenset({("GET", "/api/health"), ("GET", "/openapi.json"), ("GET", "/docs")})
#: Path prefixes open to ``GET`` in the same way: the Swagger UI files the ``/docs`` page loads.
OPEN_PREFIXES = ("/docs/static/",)
#: ``POST`` routes that run inference: they answer 402 when the caller's balance is used up.
BILLED_ROUTES = INFERENCE_ROUTES


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``key_id`` (None when the server has no keys, or for the runner's own work), ``admin``, and the
    key's ``balance`` when read (micro-units; None: unlimited)."""

    key_id: str | None
    name: str
    admin: bool
    balance: int | None = None
    #: the scopes it may use (an admin, and the caller of a server without keys: every scope)
    scopes: frozenset[str] = frozenset(SCOPES)

    @property
    def owner(self) -> str | None:
        """The owner stamped on what this caller creates (None: no owner, as before keys existed)."""
        return self.key_id

    @property
    def scope(self) -> str | None:
        """The owner filter of this caller's reads: its own key, or None (everything) for admins."""
        return None if self.admin else self.key_id


#: The runner and every caller of a server without keys: sees and owns everything.
SYSTEM = Principal(key_id=None, name="system", admin=True)

_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("miserver_principal", default=SYSTEM)


def current() -> Principal:
    """The caller of the request (or batch) being served now; :data:`SYSTEM` outside any."""
    return _current.get()


def scope() -> str | None:
    """The current caller's owner filter (:attr:`Principal.scope`): None means every owner."""
    return current().scope


def visible(owner_key_id: str | None) -> bool:
    """Whether the current caller may see an object owned by ``owner_key_id`` (admins see everything)."""
    s = scope()
    return s is None or owner_key_id == s


def keyed_route(route: str) -> str:
    """The Idempotency-Key namespace of ``route`` for the current caller (``route`` itself without keys, else
    ``route:<key id>``): keys of different callers never meet."""
    owner = current().owner
    return route if owner is None else f"{route}:{owner}"


def shown_lease(lease: Lease) -> dict[str, Any]:
    """A lease as the current caller may see it (JSON-ready): whole for an admin; for any other key without its
    token (``lease: null``), so that it cannot renew or release another holder's lease, and with another tenant's
    holder read as a neutral word (:func:`~miserver.model_lease.shown_holder`)."""
    shown = lease.as_json()
    if current().admin:
        return shown
    return {**shown, "lease": None, "holder": shown_holder(lease, scope())}


def shown_upstreams(upstreams: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Upstream health entries (``Gateway.status()``) as the current caller may see them: whole for an admin;
    ``url`` and ``last_error`` null for any other key (they describe the operator's network)."""
    if current().admin:
        return upstreams
    return [{**u, "url": None, "last_error": None} for u in upstreams]


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Run the enclosed code as ``principal`` (the runner, for a batch's owner)."""
    token = _current.set(principal)
    try:
        yield
    finally:
        _current.reset(token)


def owner_principal(key_id: str | None) -> Principal:
    """The principal under which the runner works for an object owned by ``key_id``: that key (not admin: a row
    reaches only what its owner may reach), or :data:`SYSTEM` for an object made without keys."""
    return SYSTEM if key_id is None else Principal(key_id=key_id, name=key_id, admin=False)


# -- keys ---------------------------------------------------------------------------------------------------------


def new_key() -> str:
    """A fresh API key: ``sk-`` + 32 random bytes, base64url without padding."""
    return "sk-" + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def digest(key: str) -> str:
    """The SHA-256 hex digest of ``key``: the only form in which a key is stored or compared."""
    return hashlib.sha256(key.encode()).hexdigest()


def scopes_of(record: KeyRecord) -> frozenset[str]:
    """The scopes a stored key may use: every scope for an admin key, the member default for a key made without
    scopes (every key made before scopes existed), else those it was made with."""
    if record.admin:
        return frozenset(SCOPES)
    return frozenset(MEMBER_DEFAULT_SCOPES if record.scopes is None else record.scopes)


def key_object(record: KeyRecord, key: str | None = None) -> dict[str, Any]:
    """The JSON of a key (:class:`~miserver.protocol.accounts.KeyObject`): ``{id, object, name, prefix, admin,
    balance, max_pending_batches, max_enqueued_tokens, created_at, revoked_at}``, plus ``key`` only when just made
    (shown this once)."""
    shown = KeyObject(
        id=record.id,
        name=record.name,
        prefix=record.prefix,
        admin=record.admin,
        scopes=[s for s in SCOPES if s in scopes_of(record)],
        balance=record.balance,
        max_pending_batches=record.max_pending_batches,
        max_enqueued_tokens=record.max_enqueued_tokens,
        created_at=record.created_at,
        revoked_at=record.revoked_at,
        key=key,
    )
    return shown.model_dump(exclude=None if key is not None else {"key"})


@dataclass(frozen=True)
class KeySpec:
    """What a new key is: ``name`` (1-128 characters), ``admin``, ``balance`` (micro-units; None: unlimited), its
    queue quotas (None: none) and ``scopes`` (None: the member default; ``admin`` among them makes an admin key)."""

    name: str
    admin: bool = False
    balance: int | None = None
    max_pending_batches: int | None = None
    max_enqueued_tokens: int | None = None
    scopes: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, body: Any) -> KeySpec:
        """The spec of a ``POST /api/keys`` body, parsed with :class:`~miserver.protocol.accounts.KeyCreateRequest`
        (the model the OpenAPI document shows): 400 naming the field for anything else, unknown fields too
        (``unknown_parameter``)."""
        req = parse_request(KeyCreateRequest, body, strict=True)
        scopes = None if req.scopes is None else tuple(s for s in SCOPES if s in req.scopes)
        return cls(
            name=req.name,
            admin=req.admin or (scopes is not None and "admin" in scopes),
            balance=req.balance,
            max_pending_batches=req.max_pending_batches,
            max_enqueued_tokens=req.max_enqueued_tokens,
            scopes=scopes,
        )


def _key_not_found(key_id: str) -> NotFoundError:
    return NotFoundError(f"No such API key: {key_id}", param="key_id", code="not_found")


async def create_key(store: Store, spec: KeySpec) -> tuple[KeyRecord, str]:
    """Make a key; returns its record and the key itself (to show once: only its digest is stored)."""
    key = new_key()
    async with store.tx() as conn:
        record = await store_keys.insert_key(
            conn,
            key_id=ordered_id("key_"),
            name=spec.name,
            digest=digest(key),
            prefix=key[:PREFIX_CHARS],
            admin=spec.admin,
            balance=spec.balance,
            max_pending_batches=spec.max_pending_batches,
            max_enqueued_tokens=spec.max_enqueued_tokens,
            created_at=now(),
            scopes=spec.scopes,
        )
    return record, key


async def list_keys(store: Store) -> list[KeyRecord]:
    """Every key (revoked ones too), oldest first."""
    async with store.tx() as conn:
        return await store_keys.list_keys(conn)


async def revoke_key(store: Store, key_id: str) -> KeyRecord:
    """Revoke a key: its requests get 401 and its running batches stop (the runner re-checks per chunk).
    Raises 404 for an unknown key, 409 ``key_revoked`` for one already revoked."""
    async with store.tx() as conn:
        try:
            return await store_keys.revoke(conn, key_id, now())
        except store_keys.KeyNotFound:
            record = await store_keys.get_key(conn, key_id)
    if record is None:
        raise _key_not_found(key_id)
    raise ConflictError(f"The API key {key_id} is already revoked.", param="key_id", code="key_revoked")


async def top_up(store: Store, key_id: str, body: Any) -> KeyRecord:
    """Add the ``amount`` micro-units of a ``POST /api/keys/{id}/top_up`` body (parsed strictly with
    :class:`~miserver.protocol.accounts.TopUpRequest`) to a key's balance (a credit line). Raises 400 for a body
    that is not ``{amount}`` with a positive integer, or for an unlimited or revoked key, 404 for an unknown key."""
    value = parse_request(TopUpRequest, body, strict=True).amount
    async with store.tx() as conn:
        try:
            return await store_keys.top_up(conn, key_id, value, now())
        except store_keys.KeyNotFound:
            record = await store_keys.get_key(conn, key_id)
    if record is None:
        raise _key_not_found(key_id)
    why = "is revoked" if record.revoked_at is not None else "has no balance (it is unlimited)"
    raise InvalidRequestError(f"Cannot top up the API key {key_id}: it {why}.", param="key_id")


async def get_key(store: Store, key_id: str) -> KeyRecord:
    """The key's record; 404 for an unknown key."""
    async with store.tx() as conn:
        record = await store_keys.get_key(conn, key_id)
    if record is None:
        raise _key_not_found(key_id)
    return record


class OpenExposureError(RuntimeError):
    """A server bound to a non-loopback address with no API key in the database (and no ``--insecure-no-auth``)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) is reachable only from this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def refuse_open_exposure(store: Store, host: str, insecure_no_auth: bool) -> None:
    """Raise :class:`OpenExposureError` when a server bound to ``host`` would be open to the network: not a loopback
    address, no key in the database, and ``insecure_no_auth`` not given."""
    if insecure_no_auth or is_loopback(host):
        return
    async with store.read() as conn:
        if await store_keys.any_key(conn):
            return
    raise OpenExposureError(
        f"Refusing to serve on {host} with no API key: anyone who reaches the port could use it. Create an admin key "
        "first (miserver keys create --name admin --admin), or pass --insecure-no-auth "
        "(MISERVER_INSECURE_NO_AUTH=true) to serve without keys."
    )


# -- authentication ------------------------------------------------------------------------------------------------


def presented_key(request: Request) -> str | None:
    """The key the request presents: ``Authorization: Bearer <key>``, or ``x-api-key`` on the ``/anthropic``
    routes; None when there is none."""
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if request.url.path.startswith("/anthropic/"):
        key = request.headers.get("x-api-key", "").strip()
        if key:
            return key
    return None


async def principal_for(store: Store, key: str | None) -> Principal:
    """The caller presenting ``key`` (None: no key). Raises 401 ``invalid_api_key`` for a missing key while keys
    exist, and for an unknown or revoked key. On a server without keys every caller is :data:`SYSTEM`, whatever
    it presents (clients such as the OpenAI SDK always send some key)."""
    async with store.read() as conn:
        if not store.keys_exist:  # one query a request: "any key?" until one is seen, then the key itself
            if not await store_keys.any_key(conn):
                return SYSTEM
            store.keys_exist = True
        record = await store_keys.find_by_digest(conn, digest(key)) if key is not None else None
    if key is None:
        raise AuthenticationError(
            "You didn't provide an API key. Keys go in the Authorization header: send 'Authorization: Bearer sk-...' "
            "(or 'x-api-key' on the /anthropic routes); a key in the query string is not read."
        )
    if record is None or not record.active:
        shown = key[:PREFIX_CHARS] + "..." if len(key) > PREFIX_CHARS else "***"
        state = "revoked" if record is not None else "incorrect"
        raise AuthenticationError(f"The API key provided ({shown}) is {state}.")
    return principal_of(record)


def principal_of(record: KeyRecord) -> Principal:
    """The caller using the stored key ``record``: its id, name, admin flag, balance and effective scopes
    (:func:`scopes_of`). The API's authentication, the console's sessions and the Socket.IO events all build their
    caller here."""
    return Principal(
        key_id=record.id, name=record.name, admin=record.admin, balance=record.balance, scopes=scopes_of(record)
    )


async def principal_by_id(store: Store, key_id: str) -> Principal | None:
    """The caller of the key ``key_id`` as the key is now (re-read from the store): None once it is revoked or
    deleted. For callers that keep a key's id rather than the key (console sessions, Socket.IO connections), so
    that a revoked key ends them at once."""
    async with store.read() as conn:
        record = await store_keys.get_key(conn, key_id)
    if record is None or not record.active:
        return None
    return principal_of(record)


def _store(request: Request) -> Store:
    st = request.app.state.miserver
    store = st.store
    assert isinstance(store, Store)
    return store


def is_open(method: str, path: str) -> bool:
    """Whether ``method path`` needs no key even when keys exist (:data:`OPEN_ROUTES`, :data:`OPEN_PREFIXES`)."""
    method = method.upper()
    return (method, path) in OPEN_ROUTES or (method == "GET" and path.startswith(OPEN_PREFIXES))


async def authenticate(request: Request) -> Principal:
    """The FastAPI dependency applied to the whole application: who calls (401 when keys exist and the request
    has none, or an unknown or revoked one), set for the request (:func:`current`, ``request.state.principal``).
    An inference ``POST`` by a key whose balance is used up (zero or below) is refused with 402
    ``insufficient_quota``."""
    if is_open(request.method, request.url.path):
        return SYSTEM
    principal = await principal_for(_store(request), presented_key(request))
    _current.set(principal)
    request.state.principal = principal
    route = request.scope.get("route")
    check_scopes(
        principal.scopes, needed_scopes(request.method, getattr(route, "path", request.url.path), request.headers)
    )
    if (
        request.method == "POST"
        and request.url.path in BILLED_ROUTES
        and principal.balance is not None
        and principal.balance <= 0
    ):
        raise InsufficientQuotaError(
            f"You exceeded your current quota: the balance of this API key is {principal.balance} micro-units. "
            "Top it up to go on."
        )
    return principal


async def require_admin(principal: Principal = Depends(authenticate)) -> Principal:  # noqa: B008
    """A FastAPI dependency for admin-only routes (keys, usage of others, model life): 403 ``permission_denied``
    for a key that is not an admin key. With no keys in the database everyone is the anonymous admin. (It reuses
    the request's :func:`authenticate`, which FastAPI runs once per request.)"""
    if not principal.admin:
        raise PermissionDeniedError("This route needs an admin API key.")
    return principal
