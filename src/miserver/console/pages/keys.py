"""The Keys page, read only: a member key sees its own key, an admin key every key (revoked ones too); for each its
name, id, display prefix, created time and the scopes it may use, with whether they are the member default.

The keys are read with the services that ``GET /api/keys`` and ``miserver keys list`` use, and each row is built
from the API's key object (:func:`~miserver.services.accounts.keys.key_object`), which never holds the key or its
digest. Keys are made, topped up and revoked with ``miserver keys`` or ``/api/keys``, not here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ...services.accounts import keys as accounts
from ...store.keys import KeyRecord
from ..state import console_state
from .render import key_choices, principal_of, render

router = APIRouter()

#: The fields of a key object that the page shows.
SHOWN = ("id", "name", "prefix", "admin", "scopes", "created_at", "revoked_at")


def key_row(record: KeyRecord) -> dict[str, Any]:
    """A key as the page shows it: ``{id, name, prefix, admin, scopes: [str], created_at, revoked_at, grant}``,
    times in Unix seconds (``revoked_at`` None while live), ``scopes`` the effective ones in the order of
    :data:`~miserver.protocol.accounts.SCOPES`, and ``grant`` where they come from: ``"admin"`` (an admin key has
    every scope), ``"default"`` (made without scopes: the member default) or ``"chosen"`` (made with them)."""
    shown = accounts.key_object(record)
    grant = "admin" if record.admin else ("default" if record.scopes is None else "chosen")
    return {**{k: shown[k] for k in SHOWN}, "grant": grant}


async def visible_keys(request: Request) -> list[KeyRecord]:
    """The keys the signed-in caller may see: every key for an admin key, its own key for a member key, and none on
    a server without keys (the single user)."""
    principal = principal_of(request)
    if principal.admin or principal.key_id is None:
        return await key_choices(request)
    return [await accounts.get_key(console_state(request).app_state.store, principal.key_id)]


@router.get("/keys", response_class=HTMLResponse)
async def keys(request: Request) -> HTMLResponse:
    """Keys: the caller's own key (a member) or every key (an admin), with its scopes; never a key itself."""
    principal = principal_of(request)
    rows = [key_row(r) for r in await visible_keys(request)]
    return render(request, "keys.html", {"rows": rows, "every": principal.admin, "keyless": principal.key_id is None})
