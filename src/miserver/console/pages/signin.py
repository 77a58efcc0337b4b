"""Sign-in (an API key exchanged for a session cookie, with a CSRF token bound to a short-lived cookie and a limit
on wrong keys per address) and sign-out."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ...errors import AuthenticationError
from ...services.accounts import keys as accounts
from ..access import may
from ..sessions import COOKIE, SIGNIN_COOKIE
from ..state import console_state, safe_next, set_session_cookie
from .render import check_csrf, render

router = APIRouter()


@router.get("/signin", response_class=HTMLResponse)
async def signin_page(request: Request, next: str | None = None) -> HTMLResponse:
    """The sign-in form (an API key) with a CSRF token bound to a short-lived cookie."""
    return _signin(request, next, None, 200)


def _signin(request: Request, next_url: str | None, message: str | None, status: int) -> HTMLResponse:
    token = secrets.token_urlsafe(32)
    response = render(
        request, "signin.html", {"next": safe_next(next_url), "signin_csrf": token, "message": message}, status
    )
    response.set_cookie(SIGNIN_COOKIE, token, httponly=True, samesite="strict", path="/console", max_age=3600)
    return response


@router.post("/signin", response_model=None)
async def signin(request: Request) -> Response:
    """Exchange a key for a session: a right key sets the session cookie and goes on to ``next`` (the Usage page
    instead of the job list for a key whose scopes do not allow the job list); a wrong one is refused (401) with a
    message, and after 5 wrong keys in a minute from one address the form answers 429."""
    cs = console_state(request)
    form = await request.form()
    next_url = safe_next(str(form.get("next") or ""))
    if not form.get("csrf") or form.get("csrf") != request.cookies.get(SIGNIN_COOKIE):
        return _signin(request, next_url, "The form expired: please sign in again.", 403)
    address = request.client.host if request.client else "unknown"
    wait = cs.failures.retry_after(address)
    if wait:
        response = _signin(request, next_url, f"Too many wrong keys: try again in {wait} seconds.", 429)
        response.headers["retry-after"] = str(wait)
        return response
    key = str(form.get("api_key") or "").strip()
    try:
        principal = await accounts.principal_for(cs.app_state.store, key or None)
    except AuthenticationError as exc:
        cs.failures.failed(address)
        return _signin(request, next_url, exc.message, 401)
    cs.failures.succeeded(address)
    session = cs.sessions.create(principal.key_id)
    if next_url == "/console/" and not may(principal, "GET", "/"):  # a key without batches lands on its usage
        next_url = "/console/usage"
    redirect = RedirectResponse(next_url, status_code=303)
    set_session_cookie(redirect, session, request.url.scheme == "https")
    redirect.delete_cookie(SIGNIN_COOKIE, path="/console")
    return redirect


@router.post("/signout", response_model=None)
async def signout(request: Request) -> Response:
    """End the session and clear its cookie."""
    form = await request.form()
    await check_csrf(request, str(form.get("csrf") or ""))
    console_state(request).sessions.drop(request.cookies.get(COOKIE))
    response = RedirectResponse("/console/signin", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response
