"""The gateway that keeps the pools (DESIGN §8): :class:`Gateway` discovers the upstreams at start, probes them every
``health_seconds`` (discovery refresh and liveness in one request) and rebuilds the pools. It can start from the
model lists of an earlier run (:class:`KnownUpstream`, kept by the caller: ``runtime.py`` keeps them in the store) and
hands every changed list to a callback, so that an upstream down at a restart keeps its pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .client import ServedModel, Upstream
from .config import Timeouts, UpstreamConfig
from .pool import UpstreamPool
from .retry import RetryPolicy

log = logging.getLogger("miserver.upstream")

#: ``on_models(name, base_url, models)``: an upstream's whole model list, after a probe found it changed (or after the
#: upstream's first successful probe in this process). May raise: the list is handed again after the next probe.
OnModels = Callable[[str, str, list[ServedModel]], Awaitable[None]]


@dataclass(frozen=True)
class KnownUpstream:
    """What an upstream listed in an earlier run: the base URL it had then (``UpstreamConfig.base_url``, ending in
    ``/v1``) and its models. Used only while the upstream keeps that name and that URL."""

    base_url: str
    models: tuple[ServedModel, ...]


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
