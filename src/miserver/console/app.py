"""The console as its own ASGI application, mounted at ``/console`` by ``create_app``: who the browser is (the
session cookie, :class:`ConsoleAuth`), the security headers, and the error pages. The pages are in ``pages/``,
what both share in ``state.py``, and the scopes each page needs (those of its API twin) in ``access.py``.

A request without a live session is sent to the sign-in page, except on a server with no API key, where the
console opens at once as the single user (a session is still made, for its CSRF token).
"""

from __future__ import annotations

from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import APIError, AuthenticationError
from ..services.accounts import keys as accounts
from . import pages
from .access import require_scopes
from .sessions import COOKIE, Session
from .state import ConsoleState, set_session_cookie

#: The Content-Security-Policy of every console response: nothing but this server, no inline script or style.
CSP = "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'self'"
#: Paths (below ``/console``) served without a session.
OPEN_PATHS = ("/signin", "/static/")


class ConsoleAuth:
    """ASGI middleware of the console: finds the session of the cookie, checks that its key is still good, and runs
    the page as that caller (``accounts.acting_as``); without a live session a ``GET`` is sent to sign-in (303),
    while a script request (``Accept: application/json``) or a form post gets 401. Adds the security headers to
    every answer."""

    def __init__(self, app: ASGIApp, cs: ConsoleState) -> None:
        self.app = app
        self.cs = cs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        new_cookie: list[Session] = []

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"same-origin"),
                    (b"x-frame-options", b"DENY"),
                ]
                if not any(k.lower() == b"cache-control" for k, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                if new_cookie:
                    holder = Response()
                    set_session_cookie(holder, new_cookie[0], scope.get("scheme") == "https")
                    headers += [(k, v) for k, v in holder.raw_headers if k == b"set-cookie"]
                message = {**message, "headers": headers}
            await send(message)

        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in OPEN_PATHS):
            await self.app(scope, receive, send_with_headers)
            return
        request = Request(scope)
        session = self.cs.sessions.get(request.cookies.get(COOKIE))
        principal = await self.cs.principal(session) if session is not None else None
        if principal is None and session is not None:
            self.cs.sessions.drop(session.token)
            session = None
        if session is None:
            try:
                principal = await accounts.principal_for(self.cs.app_state.store, None)
            except AuthenticationError:
                principal = None
            if principal is not None:  # no key in the database: the single user
                session = self.cs.sessions.create(None)
                new_cookie.append(session)
        if session is None or principal is None:
            answer: Response
            if scope.get("method") == "GET" and "application/json" not in request.headers.get("accept", ""):
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                answer = RedirectResponse(f"/console/signin?next={_quote(target)}", status_code=303)
            else:
                answer = JSONResponse(
                    {
                        "error": {
                            "message": "Sign in to the console first.",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "not_signed_in",
                        }
                    },
                    status_code=401,
                )
            await answer(scope, receive, send_with_headers)
            return
        scope.setdefault("state", {})
        scope["state"]["session"] = session
        scope["state"]["principal"] = principal
        with accounts.acting_as(principal):
            await self.app(scope, receive, send_with_headers)


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="/")


def create_console(parent: FastAPI) -> FastAPI:
    """The console application for ``parent`` (the miServer app whose lifespan sets ``state.miserver``). Mount it
    at ``/console``; :meth:`ConsoleState.from_cookie_header` serves the Socket.IO authentication."""

    console = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    cs = ConsoleState(parent)
    console.state.console = cs
    static = resources.files("miserver.console") / "static"
    console.mount("/static", StaticFiles(directory=str(static)), name="static")
    # every page needs the scopes of its API twin (access.py), checked before it reads its form
    console.include_router(pages.router, dependencies=[Depends(require_scopes)])

    @console.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        status, body = exc.answer_for(request.url.path)
        if "application/json" in request.headers.get("accept", ""):
            return JSONResponse(body, status_code=status)
        return cs.templates.TemplateResponse(
            request,
            "error.html",
            {"status": status, "message": exc.message, "param": body["error"].get("param"), "principal": None},
            status_code=status,
        )

    @console.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return HTMLResponse("<!doctype html><title>Not found</title><p>Not found.</p>", status_code=404)

    console.add_middleware(ConsoleAuth, cs=cs)
    return console


class ConsoleRoot:
    """ASGI middleware of the parent app: ``/console`` (which the trailing-slash rule makes of ``/console/`` too)
    is served as ``/console/``, the console's job list."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == "/console":
            scope = {**scope, "path": "/console/", "raw_path": b"/console/"}
        await self.app(scope, receive, send)
