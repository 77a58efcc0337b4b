"""A synchronous inference request whose client has gone stops at once (ASGI middleware, :class:`CancelOnDisconnect`).

A non-streamed handler is not cancelled when its client disconnects: it would run all its ``max_tokens`` and keep
the engine from everyone waiting behind it. This middleware reads the connection's next message once the request
body is in; an ``http.disconnect`` before the response has started cancels the handler, wherever it is (waiting for
an engine slot, in prefill, between decode steps), and the engine stops at its next token
(:meth:`~miserver.engines.local.engine.LocalEngine.generate`). Nothing is charged for such a request: its client
received nothing. A streamed response that has started is left to the streaming response, which stops its stream
on the same disconnect and charges the tokens it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("miserver.http")


class CancelOnDisconnect:
    """ASGI middleware over the routes ``paths``: see the module. Every other request passes through untouched."""

    def __init__(self, app: ASGIApp, paths: Collection[str]) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        later: asyncio.Queue[Message] = asyncio.Queue()  # what the connection says once the body is in
        started = False
        gone = False

        async def app_receive() -> Message:
            if body_read.is_set():
                return await later.get()
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def handle() -> None:
            await self.app(scope, app_receive, watched_send)

        handler = asyncio.create_task(handle())
        began = time.perf_counter()

        async def watch() -> None:
            nonlocal gone
            await body_read.wait()
            message = await receive()
            await later.put(message)
            if message["type"] == "http.disconnect" and not started:
                gone = True
                handler.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not gone:  # this request itself is being cancelled (the server stops): pass it on
                handler.cancel()
                raise
            log.info(
                "client went away before the answer: %s %s cancelled after %.0f ms (nothing charged)",
                scope.get("method", ""),
                scope.get("path", ""),
                (time.perf_counter() - began) * 1000,
            )
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
