"""Pools of upstreams, the gateway that keeps them, and the one retry loop (DESIGN §8).

Upstreams that list the same model id form that model's :class:`UpstreamPool`. A pool has its own admission gate
(:class:`PoolGate`: one slot per ``max_in_flight`` place of its members, interactive requests first), so the backlog
of a batch stays in miServer's durable queue, never in an upstream's memory. :func:`send` is the only retry loop:
connect errors, timeouts and the statuses of :data:`~.errors.RETRYABLE_STATUSES` are retried with jittered
exponential backoff (at least the ``Retry-After`` the upstream asked for), on another live upstream of the pool when
there is one, until the attempts or the caller's deadline run out. :class:`Gateway` discovers the upstreams at start,
probes them every ``health_seconds`` (discovery refresh and liveness in one request) and rebuilds the pools. It can
start from the model lists of an earlier run (:class:`KnownUpstream`, kept by the caller: ``runtime.py`` keeps them in
the store) and hands every changed list to a callback, so that an upstream down at a restart keeps its pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ...errors import APIError, UpstreamTimeoutError, UpstreamUnavailableError
from ...scheduling.admission import AdmissionGate
from ..base import EngineInfo
from .client import ServedModel, Upstream
from .config import Timeouts, UpstreamConfig
from .errors import RETRYABLE_STATUSES

log = logging.getLogger("miserver.upstream")

#: Longest ``Retry-After`` honoured, in seconds (a longer one is cut to this).
MAX_RETRY_AFTER = 60.0

#: ``on_models(name, base_url, models)``: an upstream's whole model list, after a probe found it changed (or after the
#: upstream's first successful probe in this process). May raise: the list is handed again after the next probe.
OnModels = Callable[[str, str, list[ServedModel]], Awaitable[None]]


@dataclass(frozen=True)
class KnownUpstream:
    """What an upstream listed in an earlier run: the base URL it had then (``UpstreamConfig.base_url``, ending in
    ``/v1``) and its models. Used only while the upstream keeps that name and that URL."""

    base_url: str
    models: tuple[ServedModel, ...]


class PoolGate(AdmissionGate):
    """An admission gate whose slots grow when an upstream joins the pool (its ``max_in_flight`` places)."""

    def add_slots(self, count: int) -> None:
        """``count`` more slots, handed at once to waiters (interactive first)."""
        self.slots += count
        for _ in range(count):
            self._release()


@dataclass
class UpstreamPool:
    """The upstreams serving ``model``. ``info`` is what a resident engine's info is to a resident row: the model id
    requests name, ``backend`` ``upstream:<names>``, the context length (0 when no member says it)."""

    model: str
    members: list[Upstream] = field(default_factory=list)
    gate: PoolGate = field(default_factory=lambda: PoolGate(1))
    _sized: bool = False

    @property
    def info(self) -> EngineInfo:
        lengths = [m.context_length for u in self.members for m in u.models if m.id == self.model and m.context_length]
        names = ",".join(u.name for u in self.members)
        return EngineInfo(
            model_id=self.model,
            backend=f"upstream:{names}",
            dtype="",
            weights_revision="",
            context_length=min(lengths) if lengths else 0,
        )

    def serving(self, upstream: Upstream) -> bool:
        """Whether ``upstream`` can take this pool's rows now: it answered its last probe (and no request to it
        failed since) and its last listing still names the model. A member that answers again but no longer lists
        the model (restarted with another model, or its port taken by another server) is left out: sent there, a
        row would get that server's 404 as its own error."""
        return upstream.live and any(m.id == self.model for m in upstream.models)

    @property
    def live(self) -> bool:
        """Whether a member serves the model now (:meth:`serving`)."""
        return any(self.serving(u) for u in self.members)

    def join(self, upstream: Upstream) -> None:
        """Add ``upstream`` (once) and its places to the gate."""
        if upstream in self.members:
            return
        self.members.append(upstream)
        if not self._sized:  # the gate was made with one slot before any member was known
            self._sized = True
            self.gate.add_slots(upstream.config.max_in_flight - 1)
        else:
            self.gate.add_slots(upstream.config.max_in_flight)

    def pick(self, avoid: Upstream | None = None) -> Upstream | None:
        """The serving member (:meth:`serving`) with the most free places (not ``avoid``, the one that just failed,
        while another serves); None when no member serves the model now."""
        live = [u for u in self.members if self.serving(u)]
        others = [u for u in live if u is not avoid] or live
        if not others:
            return None
        return max(others, key=lambda u: (u.config.max_in_flight - u.in_flight) / u.config.max_in_flight)


@dataclass
class Answer:
    """An upstream's complete answer (any status). ``response`` is set, with its body unread, for a stream that
    answered 200: the caller reads it, then calls :meth:`close`."""

    upstream: Upstream
    status: int
    content: bytes
    headers: httpx.Headers
    response: httpx.Response | None = None

    async def close(self) -> None:
        """Close a stream's response and give its place on the upstream back (once)."""
        if self.response is not None:
            response, self.response = self.response, None
            try:
                await response.aclose()
            finally:
                self.upstream.release()


class Deferred(Exception):
    """The row was not sent to completion and is not the row's fault: the deadline (a batch's ``expires_at``) came,
    or the caller stopped. A batch leaves the row unrun."""


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` per request; backoff ``base * 2**n`` seconds capped at ``cap``, jittered to 50-100%."""

    max_attempts: int = 8
    base: float = 0.5
    cap: float = 30.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait after attempt number ``attempt`` (0-based) failed; at least ``retry_after``."""
        backoff: float = min(self.cap, self.base * 2.0**attempt) * random.uniform(0.5, 1.0)
        return max(backoff, min(retry_after or 0.0, MAX_RETRY_AFTER))


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds asked by ``Retry-After`` (a number, or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        seconds: float = max(0.0, float(value))
        return seconds
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def _attempt(upstream: Upstream, path: str, payload: bytes, request_id: str, stream: bool) -> Answer:
    """One attempt on ``upstream`` under its timeouts; holds one of its places (kept for an open stream)."""
    timeouts = upstream.timeouts
    await upstream.acquire()
    keep = False
    try:
        headers = {**upstream.headers(request_id), "Content-Type": "application/json"}
        async with asyncio.timeout(timeouts.total):
            response = await upstream.send(
                "POST", path, content=payload, headers=headers, timeout=timeouts.first_byte, stream=True
            )
            if stream and response.status_code == 200:
                keep = True
                return Answer(upstream, 200, b"", response.headers, response)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        return Answer(upstream, response.status_code, content, response.headers)
    finally:
        if not keep:
            upstream.release()


async def send(
    pool: UpstreamPool,
    path: str,
    body: Any,
    *,
    request_id: str,
    policy: RetryPolicy,
    deadline: float,
    defer_at_deadline: bool,
    stream: bool = False,
    stopped: Callable[[], bool] = lambda: False,
) -> Answer:
    """POST ``body`` (JSON) to ``path`` (under ``/v1``) on the pool, retrying as the module says.

    ``deadline`` is a ``time.monotonic()`` instant: no attempt or backoff starts that would reach past it. Returns
    the first answer that is not retried (a success, or a 4xx that is the request's own), or the last retryable
    answer once attempts run out. Raises :class:`~miserver.errors.UpstreamUnavailableError` when no member is live
    (at the start, or after the live ones failed), :class:`Deferred` when the deadline comes with
    ``defer_at_deadline`` or when ``stopped()`` answers true, and, at the deadline or after the last attempt,
    :class:`~miserver.errors.UpstreamTimeoutError` (504) when the last attempt timed out or
    :class:`~miserver.errors.UpstreamUnavailableError` when it could not reach the upstream.
    """
    payload = json.dumps(body, ensure_ascii=False).encode()
    avoid: Upstream | None = None
    last: Answer | APIError | None = None
    for attempt in range(policy.max_attempts):
        if stopped():
            raise Deferred("stopped")
        upstream = pool.pick(avoid)
        if upstream is None:
            raise UpstreamUnavailableError(
                f"No upstream serving '{pool.model}' is reachable now "
                f"({', '.join(f'{u.name}: {_why(u, pool.model)}' for u in pool.members) or 'none known'}); retry later."
            )
        wait: float | None = None
        try:
            answer = await _attempt(upstream, path, payload, request_id, stream)
        except (httpx.TimeoutException, TimeoutError):
            last = UpstreamTimeoutError(
                f"The upstream '{upstream.name}' did not answer within its timeouts "
                f"(first byte {upstream.timeouts.first_byte:g} s, idle {upstream.timeouts.idle:g} s, "
                f"total {upstream.timeouts.total:g} s)."
            )
        except httpx.TransportError as exc:
            upstream.mark_down(f"{type(exc).__name__}: {exc}")
            last = UpstreamUnavailableError(f"The upstream '{upstream.name}' could not be reached: {exc!r}.")
        else:
            if answer.status not in RETRYABLE_STATUSES:
                return answer
            last = answer
            wait = retry_after(answer.headers)
            log.info("upstream %s answered %d; retrying", upstream.name, answer.status)
        avoid = upstream
        if attempt + 1 >= policy.max_attempts:
            break
        delay = policy.delay(attempt, wait)
        if time.monotonic() + delay >= deadline:
            if defer_at_deadline:
                raise Deferred("deadline")
            break
        await asyncio.sleep(delay)
    if isinstance(last, Answer):
        return last
    assert last is not None
    raise last


def _why(upstream: Upstream, model: str) -> str:
    """Why ``upstream`` takes no row of ``model`` now (the 503's message)."""
    if upstream.last_error:
        return upstream.last_error
    if upstream.live:
        return f"it no longer lists '{model}' in GET /v1/models"
    return "not probed yet"


class Gateway:
    """Every configured upstream and the pools they form, kept fresh by a probe every ``health_seconds``.

    ``known`` (by upstream name) are the model lists of an earlier run: an upstream whose name and base URL match one
    is seeded with its models at once (it stays down until a probe answers), so its pools exist while it is
    unreachable; an upstream whose URL changed is not (its old list may be wrong). ``on_models`` receives each
    upstream's list after its first successful probe and after every probe that found it changed (a failure there
    is a warning; it is handed again after the next probe).

    ``start()`` probes every upstream once (an unreachable one is a one-line warning; it stays down and is probed
    again), then keeps probing in a background task until ``close()``.
    """

    def __init__(
        self,
        configs: Sequence[UpstreamConfig],
        timeouts: Timeouts,
        policy: RetryPolicy,
        *,
        health_seconds: float = 5.0,
        known: Mapping[str, KnownUpstream] | None = None,
        on_models: OnModels | None = None,
    ) -> None:
        self.upstreams = [Upstream(c, timeouts) for c in configs]
        self.timeouts = timeouts
        self.policy = policy
        self.health_seconds = health_seconds
        self.pools: dict[str, UpstreamPool] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_models = on_models
        #: names of the upstreams whose models are known: seeded from ``known``, or answered a probe here
        self._models_known: set[str] = set()
        #: the list last handed to ``on_models``, per upstream name
        self._written: dict[str, list[ServedModel]] = {}
        self._write_failing: set[str] = set()
        #: (upstream, model) pairs already logged as dropped: the upstream answers but no longer lists the model
        self._dropped: set[tuple[str, str]] = set()
        for upstream in self.upstreams:
            entry = (known or {}).get(upstream.name)
            if entry is None:
                continue
            if entry.base_url != upstream.config.base_url:
                log.info(
                    "upstream %s: its URL changed (was %s); the models it listed there are not used",
                    upstream.name,
                    entry.base_url,
                )
                continue
            upstream.seed(list(entry.models))
            self._models_known.add(upstream.name)
            log.info(
                "upstream %s: remembered from an earlier run: %s (down until a probe answers)",
                upstream.name,
                ", ".join(m.id for m in entry.models) or "no models",
            )
        self._join_pools()

    async def start(self) -> None:
        """Probe every upstream once and start the periodic probe."""
        await self.refresh()
        self._task = asyncio.create_task(self._probe_forever(), name="miserver-upstream-health")

    async def refresh(self) -> None:
        """Probe every upstream now (concurrently), add what they serve to the pools, then hand each list that
        changed to ``on_models`` (one upstream after the other). Raises nothing but what ``on_models`` raises that
        is not an ``Exception``."""
        answered = await asyncio.gather(*(u.probe() for u in self.upstreams))
        self._join_pools()
        for upstream, live in zip(self.upstreams, answered, strict=True):
            if live:
                self._models_known.add(upstream.name)
                await self._remember(upstream)

    def _join_pools(self) -> None:
        """Add every upstream to the pools of the models it lists; log once each model a live member no longer
        lists (its rows wait for a member that lists it: ``UpstreamPool.serving``)."""
        for upstream in self.upstreams:
            for model in upstream.models:
                self.pools.setdefault(model.id, UpstreamPool(model.id)).join(upstream)
        for pool in self.pools.values():
            for member in pool.members:
                key = (member.name, pool.model)
                if any(m.id == pool.model for m in member.models):
                    self._dropped.discard(key)
                elif member.live and key not in self._dropped:
                    self._dropped.add(key)
                    log.warning(
                        "upstream %s no longer lists the model %r; its rows wait (upstream_unavailable) until an "
                        "upstream lists it again",
                        member.name,
                        pool.model,
                    )

    async def _remember(self, upstream: Upstream) -> None:
        """Hand ``upstream``'s list to ``on_models`` unless it is the one last handed; a failure is one warning per
        run of failures, and the list is handed again after the next probe."""
        if self._on_models is None or self._written.get(upstream.name) == upstream.models:
            return
        models = list(upstream.models)
        try:
            await self._on_models(upstream.name, upstream.config.base_url, models)
        except Exception as exc:
            if upstream.name not in self._write_failing:
                log.warning("upstream %s: its model list could not be remembered: %r; retrying", upstream.name, exc)
                self._write_failing.add(upstream.name)
            return
        self._write_failing.discard(upstream.name)
        self._written[upstream.name] = models

    def unknown_upstreams(self) -> list[str]:
        """Names of the upstreams whose models are not known: none of their probes answered yet in this process and
        nothing was remembered of them (``known``). A model only they serve is unknown here for now."""
        return [u.name for u in self.upstreams if u.name not in self._models_known]

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_seconds)
            try:
                await self.refresh()
            except Exception:  # a probe never raises; this keeps the loop alive whatever happens
                log.exception("upstream probe failed")

    def pool(self, model: str) -> UpstreamPool | None:
        """The pool of ``model`` (kept while its members are down: its rows wait), or None when no upstream ever
        listed it."""
        return self.pools.get(model)

    @property
    def all_live(self) -> bool:
        """Whether every configured upstream answered its last probe."""
        return all(u.live for u in self.upstreams)

    def models(self) -> list[UpstreamPool]:
        """The pools, by model id."""
        return [self.pools[m] for m in sorted(self.pools)]

    def status(self) -> list[dict[str, Any]]:
        """Per upstream: name, URL, live, models, requests in flight, last error (``/api/health/detailed``)."""
        return [
            {
                "name": u.name,
                "url": u.config.base_url,
                "live": u.live,
                "models": [m.id for m in u.models],
                "in_flight": u.in_flight,
                "max_in_flight": u.config.max_in_flight,
                "last_error": u.last_error,
            }
            for u in self.upstreams
        ]

    async def close(self) -> None:
        """Stop probing and close every client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(u.close() for u in self.upstreams))


async def start_gateway(
    entries: Sequence[str],
    timeouts: Timeouts,
    policy: RetryPolicy,
    *,
    default_max_in_flight: int,
    health_seconds: float,
    known: Mapping[str, KnownUpstream] | None = None,
    on_models: OnModels | None = None,
) -> Gateway | None:
    """The gateway of the upstream ``entries`` (``--upstream`` values), started; None when there are none.

    A malformed entry is a one-line warning and is left out; an unreachable upstream is a one-line warning and
    stays down until a probe answers. Neither stops the server. ``known`` and ``on_models`` are :class:`Gateway`'s:
    the model lists of an earlier run, and where changed lists go.
    """
    from .config import parse_upstreams

    configs, problems = parse_upstreams(entries, default_max_in_flight)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream request would drown the log
    for problem in problems:
        log.warning("%s; that entry is left out", problem)
    if not configs:
        return None
    gateway = Gateway(configs, timeouts, policy, health_seconds=health_seconds, known=known, on_models=on_models)
    await gateway.start()
    return gateway
