"""Gateway mode in the services (DESIGN §8): a request or a batch row naming an upstream model.

The endpoint services (chat, text completions, embeddings) route here when the body's model is served by an
upstream pool rather than the resident engine (:func:`target`). The body passes the endpoint's own model-free checks
(its ``parse``, strict for batch lines) and the upstream context check, then the pool's admission gate (interactive
first), then :func:`~miserver.engines.upstream.retry.send` (the one retry loop). The upstream's body comes back
unchanged but for ``model``, which keeps the name the caller sent; provenance headers say ``X-miLLM-Backend:
upstream:<name>``. Streams are relayed chunk by chunk; an error chunk inside the stream or a stream cut before
``[DONE]`` ends the relay with an error event, never as a success.

Batch rows that name an upstream model are sent by :mod:`~miserver.services.inference.upstream_rows`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from ...engines.base import Engine
from ...engines.upstream import UPSTREAM_PATHS, Answer, Gateway, UpstreamPool, send
from ...engines.upstream.errors import normalize_error, stream_error
from ...errors import ContextLengthError, UpstreamError, UpstreamUnavailableError
from ...scheduling.admission import Slot
from .context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage
from .many import Outcome, Plan

log = logging.getLogger("miserver.gateway")

#: Provenance headers an upstream miServer sets that are copied as they are.
COPIED_HEADERS = ("X-miLLM-Seed", "X-miLLM-Weights", "X-miLLM-Dtype", "X-miLLM-Grammar", "X-miLLM-Batch-Invariant")

Parse = Callable[..., Any]
LocalCheck = Callable[..., tuple[Any, Engine]]
LocalMany = Callable[[ServiceContext, list[Any], Call, Plan | None], AsyncIterator[Outcome]]


def target(ctx: ServiceContext, body: Any) -> UpstreamPool | None:
    """The upstream pool a body goes to: its ``model`` is served upstream and is not the resident model."""
    return ctx.upstream_pool(body.get("model")) if isinstance(body, dict) else None


def gateway_of(ctx: ServiceContext) -> Gateway:
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


def answer_result(answer: Answer, model: str, req: Any) -> ServiceResult:
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


def unavailable_error(pool: UpstreamPool) -> UpstreamUnavailableError:
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
        raise unavailable_error(pool)
    gateway = gateway_of(ctx)
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
                answer_result(answer, model, req)  # an error answer raises here
                raise UpstreamError(502, normalize_error(502, b"", answer.upstream.name))
        except BaseException:
            pool.gate.release(slot)
            raise
        prompt = _known_prompt_tokens(getattr(req, "prompt", None))
        events = _relay(answer, model, pool, slot, counted, hide_usage, prompt)
        return StreamResult(events, _headers(answer, model, req), counted)
    async with pool.gate.hold(call.priority):
        answer = await send(pool, UPSTREAM_PATHS[endpoint], body, defer_at_deadline=False, **kwargs)
    return answer_result(answer, model, req)


def _error_event(message: str, code: str) -> str:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def _delivered_tokens(payload: dict[str, Any]) -> int:
    """Tokens a stream chunk delivers: one per choice whose delta (chat) or text (completions) is not empty, as
    engines stream one token a chunk."""
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return 0
    count = 0
    for choice in choices:
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            count += bool(text)
    return count


def _track_choices(payload: dict[str, Any], started: set[Any], finished: set[Any]) -> None:
    """Add the ``index`` of each choice of a stream chunk to ``started``, and to ``finished`` when it carries a
    ``finish_reason``."""
    choices = payload.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if isinstance(choice, dict):
            index = choice.get("index", 0)
            started.add(index)
            if choice.get("finish_reason"):
                finished.add(index)


async def _relay(
    answer: Answer,
    model: str,
    pool: UpstreamPool,
    slot: Slot,
    counted: StreamUsage,
    hide_usage: bool,
    prompt_tokens: int = 1,
) -> AsyncIterator[str]:
    """The upstream's ``data:`` payloads with ``model`` rewritten; an error chunk is passed on in OpenAI's envelope
    and ends the stream, and a stream that ends (or breaks) before ``[DONE]`` ends with an
    ``upstream_stream_cut`` error event: neither reads as a finished answer. A stream that ends without ``[DONE]``
    once every choice it started has its ``finish_reason`` (``transformers serve`` never sends the terminator) is
    finished: the relay ends it with ``[DONE]``.

    The usage the upstream reports is kept in ``counted`` (for billing); with ``hide_usage`` (the client did not ask
    for ``stream_options.include_usage``, which was asked of the upstream for it) the usage-only chunk is not passed
    on and a usage object on another chunk is removed, so the client gets the stream it asked for. Until the
    upstream reports its usage, ``counted`` holds the tokens delivered so far (and ``prompt_tokens``, the prompt's
    tokens as far as they are known without the upstream's tokenizer): a stream cut before the upstream's usage
    chunk, by the upstream or by the client, is charged those, as the upstream charges a cut stream."""
    assert answer.response is not None
    name = answer.upstream.name
    delivered = 0
    reported = False
    started: set[Any] = set()  # choice indices seen, and those with a finish_reason
    finished: set[Any] = set()
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
                delivered += _delivered_tokens(payload)
                _track_choices(payload, started, finished)
                usage = payload.get("usage")
                if isinstance(usage, dict):
                    reported = True
                    counted.set(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                    if hide_usage:
                        if not payload.get("choices"):
                            continue  # the usage-only chunk the client did not ask for
                        del payload["usage"]
                elif not reported:
                    counted.progress(prompt_tokens, delivered)
            yield json.dumps(payload)
        if started and started == finished:
            yield "[DONE]"
            return
        yield _error_event(f"The upstream '{name}' closed the stream before it finished.", "upstream_stream_cut")
    except (httpx.HTTPError, TimeoutError) as exc:
        log.warning("stream from upstream %s cut: %r", name, exc)
        yield _error_event(
            f"The stream from the upstream '{name}' was cut: {type(exc).__name__}.", "upstream_stream_cut"
        )
    finally:
        if not reported and delivered:  # cut before the upstream said its usage: charge what was delivered
            counted.set(prompt_tokens, delivered)
        await answer.close()
        pool.gate.release(slot)


# -- the model list ----------------------------------------------------------------------------------------------------


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
