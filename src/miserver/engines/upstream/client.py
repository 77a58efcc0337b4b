"""One upstream engine: its pooled HTTP/1.1 client, what it serves (discovery) and whether it is live (health).

Discovery and the liveness probe are one cheap ``GET /v1/models``: it lists the models (and, from vLLM, each one's
``max_model_len``) and proves the server answers. A transport failure of a request marks the upstream down at once,
so that the next attempt goes to another upstream of the pool; the next successful probe marks it live again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

import httpx

from .config import Timeouts, UpstreamConfig

log = logging.getLogger("miserver.upstream")

#: Connections kept beyond ``max_in_flight`` (the probe, a request finishing while the next starts).
SPARE_CONNECTIONS = 4
#: The upstream path (under ``/v1``) of each endpoint miServer relays to upstreams; Responses reach upstreams as chat
#: requests, the other endpoints (Anthropic Messages, probes, scoring) run on the resident model only.
UPSTREAM_PATHS = {
    "/v1/chat/completions": "/chat/completions",
    "/v1/completions": "/completions",
    "/v1/embeddings": "/embeddings",
}
#: Seconds an idle pooled connection is kept for reuse. Below the keep-alive timeout of the servers in front of the
#: engines (uvicorn's default is 5 s: vLLM, SGLang and miServer itself run on it), so that miServer never reuses a
#: connection at the moment its server closes it. httpx's default is 5 s, the same as uvicorn's: a probe every 5 s
#: then sometimes met a connection just closed ("Server disconnected without sending a response").
KEEPALIVE_EXPIRY = 2.0
#: Transport errors that a connection the server had already closed gives to the request that reused it: the server
#: never read the request, so it is sent again at once (:meth:`Upstream.send`), and the upstream is not marked down.
STALE_CONNECTION_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
#: Keys of a ``/v1/models`` entry that give the context length, in order of preference.
CONTEXT_KEYS = ("max_model_len", "context_length", "max_context_length", "context_window")


@dataclass(frozen=True)
class ServedModel:
    """A model an upstream lists: its id, and its context length in tokens when the upstream says it."""

    id: str
    context_length: int | None = None


def read_models(body: Any) -> list[ServedModel]:
    """The models of a ``GET /v1/models`` body (OpenAI's list; entries without a string id are skipped)."""
    data = body.get("data") if isinstance(body, dict) else None
    models: list[ServedModel] = []
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        length = next((entry[k] for k in CONTEXT_KEYS if isinstance(entry.get(k), int) and entry[k] > 0), None)
        models.append(ServedModel(entry["id"], length))
    return models


class Upstream:
    """One OpenAI-compatible server. ``live`` is False until the first successful probe.

    ``client`` is one pooled ``httpx.AsyncClient`` (HTTP/1.1, its own retries off: miServer's retry loop is the only
    one) with room for ``max_in_flight`` requests plus the probe; :meth:`acquire` / :meth:`release` bound the
    requests in flight to ``max_in_flight`` across every pool the upstream belongs to.
    """

    def __init__(self, config: UpstreamConfig, timeouts: Timeouts) -> None:
        self.config = config
        self.name = config.name
        if config.total_timeout is not None:
            total = config.total_timeout
            timeouts = replace(timeouts, total=total, first_byte=min(timeouts.first_byte, total))
        self.timeouts = timeouts
        size = config.max_in_flight + SPARE_CONNECTIONS
        self.pool_size = size
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size, keepalive_expiry=KEEPALIVE_EXPIRY)
        self.client = httpx.AsyncClient(
            base_url=config.base_url,
            timeout=httpx.Timeout(connect=timeouts.connect, read=timeouts.idle, write=timeouts.idle, pool=None),
            transport=httpx.AsyncHTTPTransport(retries=0, http1=True, http2=False, limits=limits),
            limits=limits,
            follow_redirects=False,
        )
        self.live = False
        self.models: list[ServedModel] = []
        self.last_error: str | None = None
        self.in_flight = 0
        self._slots = asyncio.Semaphore(config.max_in_flight)

    @property
    def backend(self) -> str:
        """``upstream:<name>``: the ``X-miLLM-Backend`` of what it answers."""
        return f"upstream:{self.name}"

    def headers(self, request_id: str | None = None) -> dict[str, str]:
        """Headers of every request to it: the API key (read now from the variable the config names) and the
        row's ``X-Request-Id`` (the same on every attempt)."""
        headers: dict[str, str] = {}
        key = self.config.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    async def acquire(self) -> None:
        """Wait for one of its ``max_in_flight`` places."""
        await self._slots.acquire()
        self.in_flight += 1

    def release(self) -> None:
        """Give a place back."""
        self.in_flight -= 1
        self._slots.release()

    def mark_down(self, reason: str) -> None:
        """No further request goes to it until a probe answers (logged once per outage)."""
        if self.live:
            log.warning("upstream %s (%s) is down: %s", self.name, self.config.base_url, reason)
        self.live = False
        self.last_error = reason

    def seed(self, models: list[ServedModel]) -> None:
        """Take ``models`` as what it serves until a probe answers (a list remembered from an earlier run, so its
        pools exist while it is down). It stays down: ``live`` is left as it is (False before the first probe)."""
        self.models = list(models)

    async def probe(self) -> bool:
        """``GET /v1/models``: refresh the served models and the liveness. Returns the new ``live``; never raises."""
        try:
            response = await self.send("GET", "/models", headers=self.headers(), timeout=self.timeouts.connect + 5)
            if response.status_code != 200:
                raise ValueError(f"GET /v1/models answered HTTP {response.status_code}")
            models = read_models(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            if self.live or self.last_error is None:
                log.warning("upstream %s (%s) is not reachable: %s; retrying", self.name, self.config.base_url, reason)
            self.live = False
            self.last_error = reason
            return False
        if not self.live:
            log.info("upstream %s is live: %s", self.name, ", ".join(m.id for m in models) or "no models")
        self.models, self.live, self.last_error = models, True, None
        return True

    async def send(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        content: bytes | None = None,
        timeout: float,
        stream: bool = False,
    ) -> httpx.Response:
        """Send one request on the pooled client; ``timeout`` (seconds) bounds the wait for the response headers.

        A kept-alive connection that the server closed as it was reused fails before any response byte
        (:data:`STALE_CONNECTION_ERRORS`); the pool drops it and the request goes again at once, as many times as
        the pool holds connections (each could be such a one) and once more on a new connection, after which the
        error is raised (the server really closes connections on this request: it is down or broken). Raises what
        ``httpx`` raises, and ``TimeoutError`` when ``timeout`` passes. A server killed while the connection is being
        made can make the transport fail outside httpx's errors (anyio asks a socket already gone for its peer:
        ``AttributeError``); that is raised as the :class:`httpx.ConnectError` it is, so the retry loop treats it as
        one.
        """
        for left in range(self.pool_size, -1, -1):
            request = self.client.build_request(method, path, content=content, headers=headers)
            try:
                return await asyncio.wait_for(self.client.send(request, stream=stream), timeout)
            except STALE_CONNECTION_ERRORS:
                if left == 0:
                    raise
            except AttributeError as exc:
                raise httpx.ConnectError(f"The connection was lost while it was made: {exc}", request=request) from exc
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.client.aclose()
