"""What the console's application and its pages share: the console's state (sessions, the wrong-key limit, the
templates, the parent application), the session cookie, and where a redirect may go."""

from __future__ import annotations

import contextlib
from http.cookies import SimpleCookie
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.templating import Jinja2Templates

from ..api.common import AppState
from ..errors import AuthenticationError
from ..services.accounts import keys as accounts
from .sessions import COOKIE, FailureLimit, Session, Sessions


class ConsoleState:
    """What the console keeps: its sessions, the wrong-key limit, the templates, and the parent application (whose
    ``state.miserver`` holds the store, settings and services' context)."""

    def __init__(self, parent: FastAPI) -> None:
        self.parent = parent
        self.sessions = Sessions()
        self.failures = FailureLimit()
        folder = resources.files("miserver.console") / "templates"
        self.templates = Jinja2Templates(directory=str(folder))

    @property
    def app_state(self) -> AppState:
        st = self.parent.state.miserver
        assert isinstance(st, AppState)
        return st

    async def principal(self, session: Session) -> accounts.Principal | None:
        """Who the session acts as now: its key re-read at every request, with the key's scopes as the API's
        authentication reads them (:func:`~miserver.services.accounts.keys.principal_by_id`; None once revoked or
        deleted), or the single user while the server has no key (every scope; None once a key exists)."""
        store = self.app_state.store
        if session.key_id is None:
            try:
                return await accounts.principal_for(store, None)
            except AuthenticationError:
                return None
        return await accounts.principal_by_id(store, session.key_id)

    async def from_cookie_header(self, header: str) -> accounts.Principal | None:
        """The principal of the session named in a ``Cookie`` header (Socket.IO connections); None without one."""
        cookie: SimpleCookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(header)
        morsel = cookie.get(COOKIE)
        session = self.sessions.get(morsel.value if morsel is not None else None)
        return await self.principal(session) if session is not None else None


def console_state(request: Request) -> ConsoleState:
    """The :class:`ConsoleState` of the console application serving ``request``."""
    cs = request.app.state.console
    assert isinstance(cs, ConsoleState)
    return cs


def set_session_cookie(response: Response, session: Session, secure: bool) -> None:
    """Put ``session`` in its HttpOnly, SameSite=Strict cookie scoped to ``/console`` (and ``/socket.io``)."""
    response.set_cookie(COOKIE, session.token, httponly=True, samesite="strict", secure=secure, path="/")


def safe_next(target: str | None) -> str:
    """A redirect target inside the console (anything else, such as another host, becomes the job list)."""
    if target and target.startswith("/console") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/"
