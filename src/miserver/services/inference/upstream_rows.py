"""Batch rows in gateway mode, routed by model once, at the edge: the registry puts :func:`routed_many` in front of
each endpoint's resident many-rows call.

Rows naming an upstream model are dispatched concurrently: one feeder per pool takes the pool's gate slot for each
row in row order and starts the row at once, so ``max_in_flight`` requests are really in flight per pool while the
runner records outcomes as they arrive. A pool with no live upstream leaves its rows unrun (the runner shows
``upstream_unavailable``); a row whose batch expires while it is retried is left unrun too (``batch_expired``).

An endpoint that upstreams do not speak (Anthropic's Messages) relays its rows through a :class:`Relay`: each row goes
as the request of an endpoint they speak (chat), and its answer comes back in the endpoint's own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ...engines.upstream import UPSTREAM_PATHS, Deferred, UpstreamPool, send
from ...errors import APIError, UpstreamUnavailableError
from ...scheduling.admission import Slot
from .context import Call, ServiceContext, ServiceResult
from .many import Outcome, Plan, server_error
from .routing import (
    LocalMany,
    Parse,
    answer_result,
    check_upstream_context,
    gateway_of,
    target,
    unavailable_error,
    upstream_request_id,
)


@dataclass(frozen=True)
class Relay:
    """How the rows of an endpoint that upstreams do not speak go to them: as requests of ``endpoint`` (a key of
    ``UPSTREAM_PATHS``), ``write`` making the body sent from a row's request (as the endpoint's ``parse`` returned
    it), ``read`` making the row's answer from the upstream's result. Either may raise ``APIError`` (the row's
    error)."""

    endpoint: str
    write: Callable[[Any], dict[str, Any]]
    read: Callable[[Any, ServiceResult], ServiceResult]


def routed_many(endpoint: str, parse: Parse, local: LocalMany, relay: Relay | None = None) -> LocalMany:
    """An endpoint's many-rows call, routed by model once at the edge (the registry builds it): ``local`` itself
    when no upstream is configured, else :func:`create_many` (rows naming an upstream model go to their pool,
    through ``relay`` when upstreams do not speak the endpoint, the rest to ``local``)."""

    def many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
        if ctx.gateway is None:
            return local(ctx, bodies, call, plan)
        return create_many(ctx, endpoint, parse, local, bodies, call, plan, relay)

    return many


def create_many(
    ctx: ServiceContext,
    endpoint: str,
    parse: Parse,
    local: LocalMany,
    bodies: list[Any],
    call: Call,
    plan: Plan | None,
    relay: Relay | None = None,
) -> AsyncIterator[Outcome]:
    """An endpoint's many-rows call in gateway mode: rows naming an upstream model are dispatched concurrently
    (:func:`dispatch`; through ``relay`` when given), the others go to ``local`` (the resident many-rows call,
    packing included) at the same time; outcomes are yielded as they finish (the caller orders by
    ``Outcome.index``). Without upstream rows it is ``local`` itself. Raises
    :class:`~miserver.errors.EngineUnavailableError` (after yielding what finished) when rows were left unrun because
    their engine or pool is unavailable."""
    pools = [target(ctx, body) for body in bodies]
    if not any(pools):
        return local(ctx, bodies, call, plan)
    return _many(ctx, endpoint, parse, local, bodies, pools, call, plan, relay)


async def _many(
    ctx: ServiceContext,
    endpoint: str,
    parse: Parse,
    local: LocalMany,
    bodies: list[Any],
    pools: list[UpstreamPool | None],
    call: Call,
    plan: Plan | None,
    relay: Relay | None,
) -> AsyncIterator[Outcome]:
    rows: list[tuple[int, UpstreamPool, dict[str, Any], Any]] = []
    for i, (body, pool) in enumerate(zip(bodies, pools, strict=True)):
        if pool is None:
            continue
        try:
            req = parse(body, strict=call.strict)
            check_upstream_context(pool, req)
            sent = body if relay is None else relay.write(req)
        except APIError as exc:
            yield Outcome(i, exc, False)
            continue
        rows.append((i, pool, sent, req))
    local_rows = [i for i, pool in enumerate(pools) if pool is None]
    read = None if relay is None else relay.read
    sources = [dispatch(ctx, endpoint if relay is None else relay.endpoint, rows, call, read)]
    if local_rows:
        sources.append(_reindexed(local(ctx, [bodies[i] for i in local_rows], call, plan), local_rows))
    async for outcome in merge(sources):
        yield outcome


async def _reindexed(outcomes: AsyncIterator[Outcome], indices: list[int]) -> AsyncIterator[Outcome]:
    try:
        async for o in outcomes:
            yield Outcome(indices[o.index], o.result, o.packed)
    finally:
        await outcomes.aclose()  # type: ignore[attr-defined]


async def merge(sources: list[AsyncIterator[Outcome]]) -> AsyncIterator[Outcome]:
    """The outcomes of every source as they come. When every source has ended, the first exception a source
    raised is raised (after everything that finished was yielded). Closing the merge closes the sources."""
    if len(sources) == 1:
        async for outcome in sources[0]:
            yield outcome
        return
    queue: asyncio.Queue[Outcome | None] = asyncio.Queue()
    errors: list[BaseException] = []

    async def drain(source: AsyncIterator[Outcome]) -> None:
        try:
            async for outcome in source:
                await queue.put(outcome)
        except Exception as exc:
            errors.append(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(drain(s)) for s in sources]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is None:
                ended += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        raise errors[0]


def _monotonic_deadline(call: Call) -> float:
    return time.monotonic() + (call.deadline - time.time()) if call.deadline is not None else float("inf")


async def dispatch(
    ctx: ServiceContext,
    endpoint: str,
    rows: list[tuple[int, UpstreamPool, dict[str, Any], Any]],
    call: Call,
    read: Callable[[Any, ServiceResult], ServiceResult] | None = None,
) -> AsyncIterator[Outcome]:
    """Send checked upstream rows ``(index, pool, body, request)`` with up to the pool's gate slots in flight per
    pool (one feeder per pool, rows started in row order, each at batch priority); yield each outcome when its
    answer arrives (made by ``read`` from the upstream's result and the row's request, when given). A feeder stops
    starting rows once ``call.stopped()``; rows already sent finish and are yielded.
    Rows of a pool with no live upstream, and rows whose retries reached ``call.deadline``, are not yielded; if the
    former happened, :class:`~miserver.errors.UpstreamUnavailableError` is raised at the end."""
    gateway = gateway_of(ctx)
    path = UPSTREAM_PATHS[endpoint]
    deadline = _monotonic_deadline(call)
    queue: asyncio.Queue[Outcome | None] = asyncio.Queue()
    unavailable: list[str] = []
    running: set[asyncio.Task[None]] = set()

    async def one(index: int, pool: UpstreamPool, body: dict[str, Any], req: Any, slot: Slot) -> None:
        outcome: Outcome | None = None
        try:
            answer = await send(
                pool,
                path,
                body,
                request_id=upstream_request_id(),
                policy=gateway.policy,
                deadline=deadline,
                defer_at_deadline=True,
                stopped=call.stopped,
            )
            result = answer_result(answer, body["model"], req)
            outcome = Outcome(index, result if read is None else read(req, result), False)
        except UpstreamUnavailableError:
            unavailable.append(pool.model)
        except Deferred:
            pass
        except APIError as exc:
            outcome = Outcome(index, exc, False)
        except Exception:
            outcome = server_error(index, "the upstream row failed")
        finally:
            pool.gate.release(slot)
        if outcome is not None:
            await queue.put(outcome)

    async def feed(pool: UpstreamPool, items: list[tuple[int, UpstreamPool, dict[str, Any], Any]]) -> None:
        started: list[asyncio.Task[None]] = []
        for index, _pool, body, req in items:
            if call.stopped():
                break
            if not pool.live:
                unavailable.append(pool.model)
                break
            slot = await pool.gate.acquire(call.priority)
            if call.stopped():
                pool.gate.release(slot)
                break
            task = asyncio.create_task(one(index, pool, body, req, slot))
            running.add(task)
            task.add_done_callback(running.discard)
            started.append(task)
        await asyncio.gather(*started)

    groups: dict[str, list[tuple[int, UpstreamPool, dict[str, Any], Any]]] = {}
    for row in rows:
        groups.setdefault(row[1].model, []).append(row)
    feeders = [asyncio.create_task(feed(items[0][1], items)) for items in groups.values()]

    async def close_when_fed() -> None:
        try:
            await asyncio.gather(*feeders)
        finally:
            await queue.put(None)

    closer = asyncio.create_task(close_when_fed())
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        for task in [*feeders, *running, closer]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*feeders, *running, closer, return_exceptions=True)
    if unavailable:
        raise unavailable_error(next(p for _i, p, _b, _r in rows if p.model == unavailable[0]))
