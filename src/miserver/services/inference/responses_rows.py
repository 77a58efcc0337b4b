"""Responses batch rows: rows of the resident model one at a time through
:func:`~miserver.services.inference.responses.create`; in gateway mode, rows naming an upstream model as their chat
requests, sent as chat rows are (:func:`~miserver.services.inference.upstream_rows.create_many`: concurrently per
pool, up to its ``max_in_flight``, rows left unrun while the pool is down or once the batch expires), each answer
translated back as the synchronous route translates it (:func:`~miserver.services.inference.responses.finish`), so
a row's output is the synchronous answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ...errors import APIError
from . import chat, responses, upstream_rows
from .context import Call, ServiceContext, ServiceResult
from .many import Outcome, Plan, run_each, server_error
from .routing import target


def _resident(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    return run_each(responses.create, ctx, bodies, call, plan)


def create_many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    """Many Responses rows (``plan`` is ignored: Responses rows never pack). Yields every row at most once, in no
    fixed order (the caller orders by ``Outcome.index``); raises as
    :func:`~miserver.services.inference.upstream_rows.create_many` does."""
    if ctx.gateway is None or not any(target(ctx, body) for body in bodies):
        return _resident(ctx, bodies, call, plan)
    return _many(ctx, bodies, call, plan)


async def _many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    pending: dict[int, responses.Pending] = {}
    kept: list[int] = []  # the rows sent on: the resident ones as they are, the upstream ones as chat requests
    for i, body in enumerate(bodies):
        if target(ctx, body) is not None:
            try:
                pending[i] = await responses.begin(ctx, body, call)
            except APIError as exc:
                yield Outcome(i, exc, False)
                continue
            except Exception:
                yield server_error(i, "the upstream row failed")
                continue
        kept.append(i)
    sent = [pending[i].chat_body if i in pending else bodies[i] for i in kept]
    outcomes = upstream_rows.create_many(ctx, "/v1/chat/completions", chat.parse, _resident, sent, call, plan)
    try:
        async for o in outcomes:
            index = kept[o.index]
            p = pending.get(index)
            if p is None:
                yield Outcome(index, o.result, o.packed)
            elif isinstance(o.result, ServiceResult):
                try:
                    yield Outcome(index, await responses.finish(ctx, p, o.result), False)
                except Exception:
                    yield server_error(index, "the upstream row's Response failed")
            else:
                yield Outcome(index, responses.from_chat(o.result), False)
    finally:
        await outcomes.aclose()  # type: ignore[attr-defined]
