"""``POST /v1/responses`` (OpenAI's Responses API), translated into the chat service: one inference path.

A Responses request becomes a chat completion request (``instructions`` a system turn first, then the turns of the
``previous_response_id`` chain, then ``input``; ``max_output_tokens`` is ``max_completion_tokens``) and runs through
:func:`miserver.services.inference.chat.create`: the same admission gate, engine, seed and provenance headers as a chat
request, so at temperature 0 both return the same text. The chat completion (or its stream of chunks) is translated
back into a Response object (or OpenAI's Responses stream events).

``store`` (default true, as OpenAI's) keeps the Response and its conversation in the database for
``GET``/``DELETE /v1/responses/{id}`` and for ``previous_response_id``, for :data:`RETENTION_SECONDS` (30 days, as
files). Batch rows run :func:`create` too (one at a time: Responses rows never pack); rows naming an upstream model
are sent as chat rows (:mod:`~miserver.services.inference.responses_rows`: :func:`begin`, then :func:`finish`).

Function tools, their calls and their results are chat's tools, ``tool_calls`` and ``tool`` turns (see
:mod:`~miserver.services.inference.responses_items`); a model served by an upstream pool (gateway mode) is served
the same way, the chat request going to the upstream's ``/v1/chat/completions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...clock import now
from ...engines.base import Engine
from ...engines.upstream import UpstreamPool
from ...errors import APIError, InvalidRequestError, NotFoundError, UnsupportedParameterError
from ...ids import ordered_id, random_id
from ...protocol.parsing import parse_request
from ...protocol.responses import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    ResponseCreateRequest,
    ResponseDeleted,
    ResponseObject,
    ResponseTextConfig,
    ResponseUsage,
)
from ...protocol.responses_items import InputItemList
from ...store import responses as store_responses
from ...store.responses import StoredResponse
from ..accounts import keys as accounts
from . import chat, responses_stream, routing, text_format
from .checks import check_metadata
from .constraints import check_grammar
from .context import Call, ServiceContext, ServiceResult, StreamResult
from .responses_items import (
    Turns,
    answer_turns,
    chat_messages,
    chat_tools,
    echo_tool_choice,
    echo_tools,
    input_turns,
    listed_item,
    output_items,
)
from .tools import call_grammar, parse_tools

#: How long a stored Response is kept: 30 days after creation, as files (``FILE_DEFAULT_EXPIRY_SECONDS``'s default).
RETENTION_SECONDS = 2_592_000
#: Expired Responses are deleted when a Response is stored, at most once per this many seconds per process.
PRUNE_EVERY_SECONDS = 3600
_next_prune = {"at": 0}


def _unsupported(name: str, why: str) -> UnsupportedParameterError:
    return UnsupportedParameterError(f"Unsupported parameter: '{name}' {why}", param=name)


def _refuse_unsupported(req: ResponseCreateRequest) -> None:
    """400 ``unsupported_parameter`` naming the first field the resident engine cannot honour; neutral values
    (``background`` false, ``truncation`` ``disabled``, ...) pass."""
    if req.stop is not None:
        raise _unsupported(
            "stop",
            "is not a parameter of OpenAI's Responses API (it has no stop sequences). Send the request to "
            "/v1/chat/completions, which takes 'stop'.",
        )
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise _unsupported("reasoning", "is not supported: the resident model has no reasoning options.")
    if req.background:
        raise _unsupported("background", "is not supported: send the request synchronously, or as a batch.")
    if req.include:
        raise _unsupported("include", "is not supported: a Response here has no extra data to include.")
    if req.conversation is not None:
        raise _unsupported("conversation", "is not supported: chain stored responses with 'previous_response_id'.")
    if req.prompt is not None:
        raise _unsupported("prompt", "is not supported: this server keeps no prompt templates.")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "is not supported on /v1/responses: use /v1/chat/completions.")
    if req.truncation == "auto":
        raise _unsupported("truncation", "'auto' is not supported: an input too long for the context is refused.")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "is not supported: this server has one service tier.")
    if req.context_management is not None:
        raise _unsupported("context_management", "is not supported.")
    if req.text is not None:
        _check_text_config(req.text.format, req.text.verbosity)
    if req.stream_options is not None and req.stream is not True:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")


def _check_text_config(form: dict[str, Any] | None, verbosity: str | None) -> None:
    if verbosity is not None:
        raise _unsupported("text.verbosity", "is not supported by the resident model.")
    text_format.grammar(form)


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[ResponseCreateRequest, Engine | UpstreamPool]:
    """Parse and check a request body without running it (batch validation calls this too): 400 for schema,
    unknown (strict) and unsupported fields, tools (see
    :func:`~miserver.services.inference.responses_items.chat_tools`), 404 ``model_not_found`` (resolved as the chat
    service resolves it). Returns the request and the resident engine, or the upstream pool that serves its model
    (gateway mode: the chat request goes there). A ``previous_response_id`` is looked up when the request runs."""
    req = parse_request(ResponseCreateRequest, body, strict=strict)
    _refuse_unsupported(req)
    check_metadata(req.metadata)
    input_turns(req, [] if req.previous_response_id is None else None)
    tool_list, tool_choice = chat_tools(req)
    pool = routing.target(ctx, body)
    if pool is not None:
        routing.check_upstream_context(pool, req)
        return req, pool
    engine = ctx.resolve_model(req.model)
    form = req.text.format if req.text else None
    check_grammar(engine, text_format.grammar(form), field="text.format", schema_param="text.format.schema")
    tools = parse_tools(tool_list, tool_choice)  # checked by chat_tools
    check_grammar(engine, call_grammar(tools) if tools else None, field="tools", schema_param="tools")
    return req, engine


def _chat_body(req: ResponseCreateRequest, turns: Turns) -> dict[str, Any]:
    """The chat completion request that computes ``req`` (``turns``: the earlier turns and the input). ``user``,
    ``safety_identifier`` and ``prompt_cache_key`` go with it when set: the resident engine accepts them without
    effect, an upstream receives them as sent."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"model": req.model, "messages": system + chat_messages(turns)}
    tools, tool_choice = chat_tools(req)
    if tools is not None:
        body["tools"] = tools
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            body[name] = getattr(req, name)
    response_format = text_format.as_response_format(req.text.format if req.text else None)
    if response_format is not None:
        body["response_format"] = response_format
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def from_chat(exc: APIError) -> APIError:
    """A chat service error named as this route names it: the chat request's ``messages`` are ``input`` here, its
    ``response_format.json_schema`` is ``text.format``."""
    if exc.param is not None and exc.param.startswith("messages"):
        return type(exc)(exc.message, param="input", code=exc.code)
    if exc.param is not None and exc.param.startswith("response_format"):
        param = exc.param.replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format"
        )
        return type(exc)(exc.message.replace("response_format", "text.format"), param=param, code=exc.code)
    return exc


async def _earlier_turns(ctx: ServiceContext, previous_id: str | None) -> Turns:
    if previous_id is None:
        return []
    async with ctx.require_store().read() as conn:
        record = await store_responses.get_response(conn, previous_id, now=now())
    if record is None or not accounts.visible(record.owner_key_id):
        raise InvalidRequestError(
            f"Previous response with id '{previous_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return record.turns


def _response(
    req: ResponseCreateRequest,
    response_id: str,
    created: int,
    model: str,
    output: list[dict[str, Any]] | None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object: in progress (``output`` None: no output yet) or finished with its ``output`` items
    (``incomplete`` when the chat finish reason is ``length``); ``usage`` the chat usage (token counts)."""
    status = "in_progress" if output is None else "incomplete" if finish_reason == "length" else "completed"
    prompt_tokens = int((usage or {}).get("prompt_tokens") or 0)
    completion_tokens = int((usage or {}).get("completion_tokens") or 0)
    return ResponseObject(
        id=response_id,
        created_at=created,
        status=status,  # type: ignore[arg-type]
        completed_at=now() if status == "completed" else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        model=model,
        output=[_item(x) for x in output or []],
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        prompt_cache_key=req.prompt_cache_key,
        safety_identifier=req.safety_identifier,
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        tool_choice=echo_tool_choice(req),
        tools=echo_tools(req),
        top_p=1.0 if req.top_p is None else req.top_p,
        usage=ResponseUsage(
            input_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        if output is not None
        else None,
        user=req.user,
        metadata=req.metadata or {},
        text=ResponseTextConfig(format=text_format.echo(req.text.format if req.text else None)),
    ).model_dump()


def _item(item: dict[str, Any]) -> OutputMessage | OutputFunctionCall:
    if item["type"] == "function_call":
        return OutputFunctionCall.model_validate(item)
    return OutputMessage.model_validate(item)


async def _save(ctx: ServiceContext, response: dict[str, Any], turns: Turns) -> None:
    """Keep ``response`` and its conversation (``turns`` then its output items, with their ids, which they keep as
    input items of the Responses that continue it) for :data:`RETENTION_SECONDS`."""
    created = int(response["created_at"])
    record = StoredResponse(
        id=response["id"],
        model=response["model"],
        created_at=created,
        expires_at=created + RETENTION_SECONDS,
        body=response,
        turns=[*turns, *answer_turns(response["output"])],
        owner_key_id=accounts.current().owner,
    )
    at = now()
    async with ctx.require_store().tx() as conn:
        await store_responses.insert_response(conn, record)
        if at >= _next_prune["at"]:
            await store_responses.prune_expired(conn, now=at)
            _next_prune["at"] = at + PRUNE_EVERY_SECONDS


@dataclass(frozen=True)
class Pending:
    """A checked Responses request as its chat request (``chat_body``), not run yet: ``turns`` the conversation
    (the ``previous_response_id`` chain's turns, then ``input``), the ids and the time (Unix seconds) of its
    Response."""

    req: ResponseCreateRequest
    turns: Turns
    chat_body: dict[str, Any]
    response_id: str
    message_id: str
    created: int


async def begin(ctx: ServiceContext, body: Any, call: Call) -> Pending:
    """Check ``body`` (:func:`check`), look up its ``previous_response_id`` chain and write its chat request. Raises
    :class:`~miserver.errors.APIError` as :func:`check` does, 400 ``previous_response_not_found``, and 400 on a
    ``function_call_output`` that answers no earlier call."""
    req, _engine = check(ctx, body, strict=call.strict)
    earlier = await _earlier_turns(ctx, req.previous_response_id)
    turns = earlier + input_turns(req, earlier)
    return Pending(req, turns, _chat_body(req, turns), ordered_id("resp_"), random_id("msg_"), now())


async def finish(ctx: ServiceContext, p: Pending, result: ServiceResult) -> ServiceResult:
    """The Response of ``p`` from its chat completion ``result`` (the resident engine's or an upstream's), stored
    unless ``store`` is false; the chat result's headers and token counts."""
    choice = result.body["choices"][0]
    finish_reason = choice.get("finish_reason") or "stop"
    status = "incomplete" if finish_reason == "length" else "completed"
    output = output_items(choice["message"], p.message_id, status)
    usage = result.body.get("usage")
    response = _response(p.req, p.response_id, p.created, result.body["model"], output, finish_reason, usage)
    if p.req.store is not False:
        await _save(ctx, response, p.turns)
    return ServiceResult(200, response, result.headers, result.prompt_tokens, result.completion_tokens)


def _streamed(ctx: ServiceContext, p: Pending, result: StreamResult) -> StreamResult:
    """The Responses events of ``p`` over its chat stream ``result``; the Response is stored when it ends."""
    model = result.headers.get("X-miLLM-Model", p.req.model)

    def build(output: list[dict[str, Any]], finish_reason: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return _response(p.req, p.response_id, p.created, model, output, finish_reason, usage)

    async def save(response: dict[str, Any]) -> None:
        await _save(ctx, response, p.turns)

    started = _response(p.req, p.response_id, p.created, model, None)
    events = responses_stream.events(result, started, p.message_id, build, save if p.req.store is not False else None)
    # the chat stream's own counts (result.usage) bill this stream, also when its client goes away midway
    return StreamResult(events, result.headers, result.usage)


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Run a Responses request through the chat service (the resident engine, or the upstream pool that serves its
    model). Returns a :class:`ServiceResult` whose body is the Response object, or a :class:`StreamResult` of
    Responses stream events (JSON text, each with its ``type`` and ``sequence_number``; see
    :func:`~miserver.services.inference.responses_stream.events`) when ``stream`` is true. Raises
    :class:`~miserver.errors.APIError` as :func:`begin` does, and as the chat service does (a ``messages`` param
    named ``input``)."""
    p = await begin(ctx, body, call)
    try:
        result = await chat.create(ctx, p.chat_body, call)
    except APIError as exc:
        raise from_chat(exc) from None
    if isinstance(result, StreamResult):
        return _streamed(ctx, p, result)
    return await finish(ctx, p, result)


async def retrieve(ctx: ServiceContext, response_id: str) -> dict[str, Any]:
    """The stored Response ``response_id``; 404 when there is none (never stored, deleted, or expired)."""
    async with ctx.require_store().read() as conn:
        record = await store_responses.get_response(conn, response_id, now=now())
    if record is None or not accounts.visible(record.owner_key_id):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return record.body


#: Largest page of ``GET /v1/responses/{id}/input_items`` (OpenAI's bound); 20 by default.
INPUT_ITEMS_LIMIT_MAX = 100


async def input_items(
    ctx: ServiceContext, response_id: str, *, limit: int = 20, order: str = "desc", after: str | None = None
) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the items that went into a stored Response, the conversation it
    continued (``previous_response_id``) included and instructions excluded, newest first unless ``order`` is
    ``asc``; a page of ``limit`` items after the item ``after``. Raises 400 for ``limit`` outside
    1..:data:`INPUT_ITEMS_LIMIT_MAX`, an ``order`` other than ``asc``/``desc`` and an ``after`` that names no item of
    this Response; 404 as :func:`retrieve`."""
    if not 1 <= limit <= INPUT_ITEMS_LIMIT_MAX:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {INPUT_ITEMS_LIMIT_MAX}.", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"Invalid 'order': {order!r}. Use 'asc' or 'desc'.", param="order")
    async with ctx.require_store().read() as conn:
        record = await store_responses.get_response(conn, response_id, now=now())
    if record is None or not accounts.visible(record.owner_key_id):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    answer = len(record.body.get("output") or []) or 1  # the last turns are this Response's own output items
    items = [listed_item(record.turns, i) for i in range(len(record.turns) - answer)]
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.id == after), None)
        if at is None:
            raise InvalidRequestError(f"Invalid 'after': no input item {after!r} in this response.", param="after")
        items = items[at + 1 :]
    page = items[:limit]
    return InputItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(items) > limit,
    ).model_dump()


async def delete(ctx: ServiceContext, response_id: str) -> dict[str, Any]:
    """Delete the stored Response ``response_id``: ``{"id", "object": "response", "deleted": true}``; 404 when
    there is none."""
    async with ctx.require_store().tx() as conn:
        deleted = await store_responses.delete_response(conn, response_id, now=now(), owner=accounts.scope())
    if not deleted:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return ResponseDeleted(id=response_id).model_dump()
