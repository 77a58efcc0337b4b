"""Webhooks: the rules of registering an endpoint, and of where deliveries may go.

``POST /api/webhooks {"url", "events"}`` registers a URL for some of the batch events (:data:`EVENTS`); the answer
shows the signing secret (``whsec_`` + base64 of 24 random bytes, Standard Webhooks) this once. A destination on a
private, loopback, link-local or otherwise non-public address is refused unless ``MISERVER_WEBHOOK_ALLOW_PRIVATE``,
at registration and again before every delivery (a name may resolve elsewhere later).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import secrets
import socket
from typing import Any
from urllib.parse import urlsplit

from ...clock import now
from ...errors import InvalidRequestError, NotFoundError
from ...protocol.parsing import parse_request
from ...protocol.webhooks import WebhookCreateRequest, WebhookObject
from ...store import Store
from ...store import outbox as store_outbox
from ..accounts import keys as accounts
from ..inference.checks import decode_json

#: The events an endpoint may subscribe to: the terminal statuses, and ``batch.progress`` while a batch runs (at
#: most every ``MISERVER_WEBHOOK_PROGRESS_SECONDS``).
EVENTS: tuple[str, ...] = (*store_outbox.STATUS_EVENTS.values(), store_outbox.PROGRESS_EVENT)


class DestinationRefused(Exception):
    """A delivery's destination is not allowed (a non-public address) or cannot be resolved; the message says why."""


def new_secret() -> str:
    """A Standard Webhooks signing secret: ``whsec_`` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast or ip.is_unspecified
    )


async def check_destination(url: str, *, allow_private: bool) -> None:
    """The URL's host must resolve, and (unless ``allow_private``) only to public addresses; raises
    :class:`DestinationRefused` naming the address otherwise."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise DestinationRefused(f"the URL {url!r} has an invalid port") from None
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise DestinationRefused(f"the host {host!r} does not resolve") from None
    if allow_private:
        return
    for info in infos:
        address = str(info[4][0])
        if not _public(address):
            raise DestinationRefused(
                f"the host {host!r} resolves to the non-public address {address} "
                "(set MISERVER_WEBHOOK_ALLOW_PRIVATE=1 to allow private and loopback destinations)"
            )


def check(body: Any) -> WebhookCreateRequest:
    """Parse and check a create body: an http(s) URL with a host, known and distinct events; 400 naming the param."""
    req = parse_request(WebhookCreateRequest, body, strict=True)
    parts = urlsplit(req.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(f"Invalid 'url': {req.url!r} is not an http or https URL with a host.", param="url")
    for i, event in enumerate(req.events):
        if event not in EVENTS:
            raise InvalidRequestError(
                f"Invalid 'events[{i}]': {event!r}. Supported: {', '.join(EVENTS)}.", param=f"events[{i}]"
            )
    if len(set(req.events)) != len(req.events):
        raise InvalidRequestError("Invalid 'events': an event is listed twice.", param="events")
    return req


async def create(store: Store, raw: bytes, *, allow_private: bool) -> dict[str, Any]:
    """Register an endpoint for the calling key (it receives the events of that key's batches; without keys, or for
    an admin key, of every batch); returns its object with the secret (shown this once). Raises 400 for the body
    and for a refused destination (param ``url``)."""
    principal = accounts.current()
    owner_key_id = None if principal.admin else principal.owner
    req = check(decode_json(raw))
    try:
        await check_destination(req.url, allow_private=allow_private)
    except DestinationRefused as exc:
        raise InvalidRequestError(f"Invalid 'url': {exc}.", param="url") from None
    async with store.tx() as conn:
        record = await store_outbox.insert_webhook(
            conn, url=req.url, events=list(req.events), secret=new_secret(), owner_key_id=owner_key_id, created_at=now()
        )
    return WebhookObject(
        id=record.id, url=record.url, events=record.events, created_at=record.created_at, secret=record.secret
    ).model_dump()


async def list_all(store: Store) -> list[dict[str, Any]]:
    """The caller's endpoints (every one for an admin), oldest first, without secrets."""
    async with store.tx() as conn:
        found = [w for w in await store_outbox.list_webhooks(conn) if accounts.visible(w.owner_key_id)]
    return [
        WebhookObject(id=w.id, url=w.url, events=w.events, created_at=w.created_at).model_dump(exclude={"secret"})
        for w in found
    ]


async def delete(store: Store, webhook_id: str) -> dict[str, Any]:
    """Delete an endpoint (its undelivered events go with it); 404 ``not_found`` when there is none."""
    async with store.tx() as conn:
        found = await store_outbox.get_webhook(conn, webhook_id)
        if (
            found is None
            or not accounts.visible(found.owner_key_id)
            or not await store_outbox.delete_webhook(conn, webhook_id)
        ):
            raise NotFoundError(f"No such webhook endpoint: {webhook_id}", param="webhook_id")
    return {"id": webhook_id, "object": "webhook_endpoint", "deleted": True}
