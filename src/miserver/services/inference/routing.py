"""Gateway mode in the services (DESIGN §8): a request or a batch row naming an upstream model.

The endpoint services (chat, text completions, embeddings) route here when the body's model is served by an
upstream pool rather than the resident engine (:func:`target`). The body passes the endpoint's own model-free checks
(its ``parse``, strict for batch lines) and the upstream context check, then the pool's admission gate (interactive
first), then :func:`~miserver.engines.upstream.retry.send` (the one retry loop). The upstream's body comes back
unchanged but for ``model``, which keeps the name the caller sent; provenance headers say ``X-miLLM-Backend:
upstream:<name>``. Streams are relayed chunk by chunk; an error chunk inside the stream or a stream cut before
``[DONE]`` ends the relay with an error event, never as a success.

Batch rows (:func:`create_many`) are dispatched concurrently: one feeder per pool takes the pool's gate slot for
each row in row order and starts the row at once, so ``max_in_flight`` requests are really in flight per pool while
the runner records outcomes as they arrive. A pool with no live upstream leaves its rows unrun (the runner shows
``upstream_unavailable``); a row whose batch expires while it is retried is left unrun too (``batch_expired``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from ...engines.base import Engine
from ...engines.upstream import UPSTREAM_PATHS, Answer, Deferred, Gateway, UpstreamPool, send
from ...engines.upstream.errors import normalize_error, stream_error
from ...errors import APIError, ContextLengthError, UpstreamError, UpstreamUnavailableError
from ...scheduling.admission import Slot
from .context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage
from .many import Outcome, Plan, server_error

log = logging.getLogger("miserver.gateway")

#: Provenance headers an upstream miServer sets that are copied as they are.
COPIED_HEADERS = ("X-miLLM-Seed", "X-miLLM-Weights", "X-miLLM-Dtype")

Parse = Callable[..., Any]
LocalCheck = Callable[..., tuple[Any, Engine]]
LocalMany = Callable[[ServiceContext, list[Any], Call, Plan | None], AsyncIterator[Outcome]]


def target(ctx: ServiceContext, body: Any) -> UpstreamPool | None:
    """The upstream pool a body goes to: its ``model`` is served upstream and is not the resident model."""
    return ctx.upstream_pool(body.get("model")) if isinstance(body, dict) else None


def _gateway(ctx: ServiceContext) -> Gateway:
    assert ctx.gateway is not None, "an upstream pool exists only in gateway mode"
    return ctx.gateway


def _known_prompt_tokens(value: Any) -> int:
    """A lower bound of a prompt's tokens without a tokenizer: exact for token ids, else 1."""
    if isinstance(value, list) and value and all(isinstance(x, int) for x in value):
        return len(value)
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        return max(len(x) for x in value)
    return 1


def check_upstream_context(pool: UpstreamPool, req: Any) -> None:
    """400 ``context_length_exceeded`` before sending when the pool's context length is known (vLLM's
    ``max_model_len``) and the request cannot fit it: its ``max_tokens`` (or ``max_completion_tokens``) plus the
    prompt's tokens as far as they are known without the upstream's tokenizer (token-id prompts exactly, text as at
    least one token). Some engines would cut the prompt silently instead."""
    limit = pool.info.context_length
    if not limit:
        return
    completion = getattr(req, "max_completion_tokens", None) or getattr(req, "max_tokens", None) or 0
    prompt = _known_prompt_tokens(getattr(req, "prompt", None) or getattr(req, "input", None))
    if prompt + completion > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested at least "
            f"{prompt + completion} tokens ({prompt} in the prompt, {completion} in the completion). Please reduce "
            "the length of the prompt or the completion.",
            param="max_tokens" if completion >= limit else ("messages" if hasattr(req, "messages") else "prompt"),
        )


def route_check(
    ctx: ServiceContext, body: Any, strict: bool, parse: Parse, local: LocalCheck
) -> tuple[Any, Engine | UpstreamPool]:
    """An endpoint's ``check``: ``local`` (the resident checks and model resolution) unless the body names an
    upstream model; then ``parse`` (the same checks that need no model) and :func:`check_upstream_context`.
    Returns ``(request, engine or pool)``; both have ``info.model_id``. Raises ``APIError`` as the route would."""
    pool = target(ctx, body)
    if pool is None:
        return local(ctx, body, strict=strict)
    req = parse(body, strict=strict)
    check_upstream_context(pool, req)
    return req, pool


def _headers(answer: Answer, model: str, req: Any) -> dict[str, str]:
    headers = {"X-miLLM-Model": model, "X-miLLM-Backend": answer.upstream.backend}
    for name in COPIED_HEADERS:
        value = answer.headers.get(name)
        if value:
            headers[name] = value
    seed = getattr(req, "seed", None)
    if "X-miLLM-Seed" not in headers and seed is not None:
        headers["X-miLLM-Seed"] = f'{seed};scope="request"'
    return headers


def _result(answer: Answer, model: str, req: Any) -> ServiceResult:
    """The service result of a complete answer; raises :class:`~miserver.errors.UpstreamError` for an error
    answer (its status, its envelope normalised to OpenAI's)."""
    name = answer.upstream.name
    if answer.status != 200:
        raise UpstreamError(answer.status, normalize_error(answer.status, answer.content, name))
    try:
        body = json.loads(answer.content)
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        message = f"The upstream '{name}' answered 200 with a body that is not a JSON object."
        raise UpstreamError(502, json.loads(_error_event(message, "upstream_bad_response")))
    if "model" in body:
        body["model"] = model
    usage = body.get("usage")
    prompt, completion = (
        (_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))
        if isinstance(usage, dict)
        else (0, 0)
    )
    return ServiceResult(200, body, _headers(answer, model, req), prompt, completion)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _unavailable(pool: UpstreamPool) -> UpstreamUnavailableError:
    reasons = "; ".join(f"{u.name}: {u.last_error or 'not probed yet'}" for u in pool.members)
    return UpstreamUnavailableError(
        f"No upstream serving '{pool.model}' is reachable now ({reasons}). Retry in a moment."
    )


def upstream_request_id() -> str:
    """The ``X-Request-Id`` of one request sent upstream (the same on each of its attempts): a random UUID4 string,
    the one form every engine accepts. llama-cpp-python's server (starlette-context's ``RequestIdPlugin``) answers any
    other value with an empty 400; vLLM and SGLang take any string."""
    return str(uuid.uuid4())


async def create(
    ctx: ServiceContext, pool: UpstreamPool, endpoint: str, req: Any, body: dict[str, Any], call: Call
) -> ServiceResult | StreamResult:
    """A synchronous request for an upstream model (``req`` is the body as ``parse`` checked it).

    Takes the pool's gate at ``call.priority``; all attempts end within the total timeout (its members' longest) of
    the request's start.
    Raises 503 ``upstream_unavailable`` when no member is live, 504 ``upstream_timeout``, or the upstream's own error
    (:class:`~miserver.errors.UpstreamError`). A stream holds its gate slot until the relay ends.
    """
    check_upstream_context(pool, req)
    if not pool.live:
        raise _unavailable(pool)
    gateway = _gateway(ctx)
    model = body["model"]
    deadline = time.monotonic() + max((u.timeouts.total for u in pool.members), default=gateway.timeouts.total)
    kwargs: dict[str, Any] = {"request_id": upstream_request_id(), "policy": gateway.policy, "deadline": deadline}
    if getattr(req, "stream", None) is True:
        # The usage is always asked of the upstream, so that every stream can be billed; a client that did not ask
        # for it does not see it (see _relay).
        options = body.get("stream_options")
        hide_usage = not (isinstance(options, dict) and options.get("include_usage") is True)
        sent = {**body, "stream_options": {**(options or {}), "include_usage": True}} if hide_usage else body
        counted = StreamUsage()
        slot = await pool.gate.acquire(call.priority)
        try:
            answer = await send(pool, UPSTREAM_PATHS[endpoint], sent, defer_at_deadline=False, stream=True, **kwargs)
            if answer.response is None:
                _result(answer, model, req)  # an error answer raises here
                raise UpstreamError(502, normalize_error(502, b"", answer.upstream.name))
        except BaseException:
            pool.gate.release(slot)
            raise
        events = _relay(answer, model, pool, slot, counted, hide_usage)
        return StreamResult(events, _headers(answer, model, req), counted)
    async with pool.gate.hold(call.priority):
        answer = await send(pool, UPSTREAM_PATHS[endpoint], body, defer_at_deadline=False, **kwargs)
    return _result(answer, model, req)


def _error_event(message: str, code: str) -> str:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


async def _relay(
    answer: Answer, model: str, pool: UpstreamPool, slot: Slot, counted: StreamUsage, hide_usage: bool
) -> AsyncIterator[str]:
    """The upstream's ``data:`` payloads with ``model`` rewritten; an error chunk is passed on in OpenAI's envelope
    and ends the stream, and a stream that ends (or breaks) before ``[DONE]`` ends with an
    ``upstream_stream_cut`` error event: neither reads as a finished answer.

    The usage the upstream reports is kept in ``counted`` (for billing); with ``hide_usage`` (the client did not ask
    for ``stream_options.include_usage``, which was asked of the upstream for it) the usage-only chunk is not passed
    on and a usage object on another chunk is removed, so the client gets the stream it asked for."""
    assert answer.response is not None
    name = answer.upstream.name
    try:
        async for line in answer.response.aiter_lines():
            if not line.startswith("data:"):
                continue  # comments, event names, blank separators
            data = line[5:].strip()
            if data == "[DONE]":
                yield "[DONE]"
                return
            try:
                payload = json.loads(data)
            except ValueError:
                yield _error_event(
                    f"The upstream '{name}' sent a stream chunk that is not JSON.", "upstream_bad_response"
                )
                return
            error = stream_error(payload)
            if error is not None:
                yield json.dumps(error)
                return
            if isinstance(payload, dict):
                if "model" in payload:
                    payload["model"] = model
                usage = payload.get("usage")
                if isinstance(usage, dict):
                    counted.set(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                    if hide_usage:
                        if not payload.get("choices"):
                            continue  # the usage-only chunk the client did not ask for
                        del payload["usage"]
            yield json.dumps(payload)
        yield _error_event(f"The upstream '{name}' closed the stream before it finished.", "upstream_stream_cut")
    except (httpx.HTTPError, TimeoutError) as exc:
        log.warning("stream from upstream %s cut: %r", name, exc)
        yield _error_event(
            f"The stream from the upstream '{name}' was cut: {type(exc).__name__}.", "upstream_stream_cut"
        )
    finally:
        await answer.close()
        pool.gate.release(slot)


# -- batch rows -----------------------------------------------------------------------------------------------


def create_many(
    ctx: ServiceContext,
    endpoint: str,
    parse: Parse,
    local: LocalMany,
    bodies: list[Any],
    call: Call,
    plan: Plan | None,
) -> AsyncIterator[Outcome]:
    """An endpoint's many-rows call in gateway mode: rows naming an upstream model are dispatched concurrently
    (:func:`dispatch`), the others go to ``local`` (the resident many-rows call, packing included) at the same
    time; outcomes are yielded as they finish (the caller orders by ``Outcome.index``). Without upstream rows it
    is ``local`` itself. Raises :class:`~miserver.errors.EngineUnavailableError` (after yielding what finished)
    when rows were left unrun because their engine or pool is unavailable."""
    pools = [target(ctx, body) for body in bodies]
    if not any(pools):
        return local(ctx, bodies, call, plan)
    return _many(ctx, endpoint, parse, local, bodies, pools, call, plan)


async def _many(
    ctx: ServiceContext,
    endpoint: str,
    parse: Parse,
    local: LocalMany,
    bodies: list[Any],
    pools: list[UpstreamPool | None],
    call: Call,
    plan: Plan | None,
) -> AsyncIterator[Outcome]:
    rows: list[tuple[int, UpstreamPool, dict[str, Any], Any]] = []
    for i, (body, pool) in enumerate(zip(bodies, pools, strict=True)):
        if pool is None:
            continue
        try:
            req = parse(body, strict=call.strict)
            check_upstream_context(pool, req)
        except APIError as exc:
            yield Outcome(i, exc, False)
            continue
        rows.append((i, pool, body, req))
    local_rows = [i for i, pool in enumerate(pools) if pool is None]
    sources = [dispatch(ctx, endpoint, rows, call)]
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
    ctx: ServiceContext, endpoint: str, rows: list[tuple[int, UpstreamPool, dict[str, Any], Any]], call: Call
) -> AsyncIterator[Outcome]:
    """Send checked upstream rows ``(index, pool, body, request)`` with up to the pool's gate slots in flight per
    pool (one feeder per pool, rows started in row order, each at batch priority); yield each outcome when its
    answer arrives. A feeder stops starting rows once ``call.stopped()``; rows already sent finish and are yielded.
    Rows of a pool with no live upstream, and rows whose retries reached ``call.deadline``, are not yielded; if the
    former happened, :class:`~miserver.errors.UpstreamUnavailableError` is raised at the end."""
    gateway = _gateway(ctx)
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
            outcome = Outcome(index, _result(answer, body["model"], req), False)
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
        raise _unavailable(next(p for _i, p, _b, _r in rows if p.model == unavailable[0]))


def list_models(ctx: ServiceContext, created: int) -> list[dict[str, Any]]:
    """``GET /v1/models``: the resident model (``owned_by`` ``miserver``), then every upstream model not resident,
    once each, ``owned_by`` naming its upstreams (``upstream:a,b``)."""
    listed: list[dict[str, Any]] = []
    if ctx.engine is not None:
        info = ctx.engine.info
        listed.append(_model(info.model_id, created, "miserver"))
    if ctx.gateway is not None:
        for pool in ctx.gateway.models():
            if ctx.upstream_pool(pool.model) is pool:
                listed.append(_model(pool.model, created, pool.info.backend))
    return listed


def _model(model_id: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
