"""Metering of synchronous requests: the usage record of each successful call of a key (:func:`record_realtime`,
keyed by its request id), written by the :func:`billed` wrapper of an endpoint service; a stream is counted when it
ends or is cut, from the producer's own count or the usage its events report. Costs at the realtime prices of
:mod:`miserver.services.accounts.prices`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ...clock import now
from ...ids import random_id
from ...scheduling.admission import Priority
from ...store import Store
from ...store import usage as store_usage
from ...store.usage import Usage
from ..accounts import keys as accounts
from ..accounts.prices import PriceTable, cost
from .context import Call, ServiceContext, ServiceResult, StreamResult


def result_model(result: ServiceResult) -> str:
    """The model that served a result: its ``X-miLLM-Model`` header, else the body's ``model``."""
    return str(result.headers.get("X-miLLM-Model") or result.body.get("model") or "")


async def record_realtime(
    store: Store,
    prices: PriceTable,
    principal: accounts.Principal,
    endpoint: str,
    model: str,
    input_tokens: int,
    output_tokens: int,
    request_id: str,
) -> bool:
    """Write the usage record of a successful synchronous request of ``principal`` and charge it (one transaction,
    unique per ``request_id``). Nothing for a caller without a key. Returns whether a record was written."""
    if principal.key_id is None:
        return False
    usage = Usage(
        key_id=principal.key_id,
        model=model,
        kind="realtime",
        endpoint=endpoint,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost(prices.realtime(model), input_tokens, output_tokens),
        created_at=now(),
        request_id=request_id,
    )
    async with store.tx() as conn:
        return await store_usage.record_usage(conn, usage)


def _stream_usage(payload: str) -> tuple[int, int] | None:
    """``(input, output)`` tokens of a streamed event that reports usage (chat and completions with
    ``include_usage``, Responses' ``response.completed``, Anthropic's ``message_delta``); None otherwise."""
    if '"usage"' not in payload:
        return None
    text = payload.split("data: ", 1)[-1] if payload.startswith("event:") else payload
    try:
        event = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    nested = event.get("response") or event.get("message") or {}
    usage = event.get("usage") or (nested.get("usage") if isinstance(nested, dict) else None)
    if not isinstance(usage, dict):
        return None
    i = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    o = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return int(i), int(o)


Create = Callable[[ServiceContext, Any, Call], Awaitable[ServiceResult | StreamResult]]


def billed(endpoint: str, create: Create) -> Create:
    """``create`` of an endpoint service, recording the usage of each successful synchronous call of a key (a
    stream: when it ends, from the producer's own count (:class:`StreamUsage`), else from the usage its events
    report). Batch calls (priority batch) pass through: the runner records
    their usage with the row."""

    async def run(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
        result = await create(ctx, body, call)
        principal = accounts.current()
        if principal.key_id is None or call.priority is Priority.BATCH or ctx.store is None:
            return result
        store, prices = ctx.store, ctx.prices or PriceTable()
        if isinstance(result, ServiceResult):
            if result.status_code == 200:
                model = result_model(result)
                await record_realtime(
                    store,
                    prices,
                    principal,
                    endpoint,
                    model,
                    result.prompt_tokens,
                    result.completion_tokens,
                    random_id("req_"),
                )
            return result
        model = str(result.headers.get("X-miLLM-Model", ""))

        async def events() -> AsyncIterator[str]:
            # The last event is held back until the usage is recorded, so a client that has read the whole stream
            # can already see its usage. A client that goes away midway (its response task cancelled, or the
            # stream closed) is charged for the tokens computed until then.
            seen: tuple[int, int] | None = None  # Anthropic's stream tells input and output in separate events
            held: str | None = None
            try:
                async for payload in result.events:
                    found = _stream_usage(payload)
                    if found is not None:
                        seen = found if seen is None else (max(seen[0], found[0]), max(seen[1], found[1]))
                    if held is not None:
                        yield held
                    held = payload
            except (asyncio.CancelledError, GeneratorExit):
                so_far = (result.usage.prompt_tokens, result.usage.completion_tokens)
                if seen is not None:
                    so_far = (max(so_far[0], seen[0]), max(so_far[1], seen[1]))
                if any(so_far):  # runs to its end although this task is being cancelled
                    charge = record_realtime(store, prices, principal, endpoint, model, *so_far, random_id("req_"))
                    await store.finish(charge)
                raise
            if result.usage.known:  # the producer's own count, whether or not the client asked to see usage
                seen = (result.usage.prompt_tokens, result.usage.completion_tokens)
            if seen is not None:
                await store.finish(record_realtime(store, prices, principal, endpoint, model, *seen, random_id("req_")))
            if held is not None:
                yield held

        return StreamResult(events(), result.headers, result.usage)

    return run
