"""``POST /anthropic/v1/messages`` (Anthropic's Messages API), translated into the chat service: one inference path.

A Messages body is checked here (its own schema and refusals, named in its own fields), written as the equivalent
chat body (:func:`~miserver.services.inference.messages_chat.chat_body`: turns, tools, ``tool_choice``) with chat
:class:`~miserver.services.inference.chat.Extras` (``stop_sequences`` of any number, ``top_k``), and run by
:func:`miserver.services.inference.chat.create`: the same model resolution, tool prompt and grammar, tokenisation,
context check, seed, admission gate and provenance headers as a chat request, so a Messages request and the
equivalent chat request produce the same text at temperature 0. A model served by an upstream pool goes there as that
chat request (upstreams speak chat), and its chat completion comes back as a Message too.

The answer is Anthropic's Message (:func:`~miserver.services.inference.messages_chat.message`); a stream is
Anthropic's event sequence (:mod:`~miserver.services.inference.messages_stream`). Batch rows run :func:`create` one at
a time on the resident engine; rows naming an upstream model are relayed concurrently by
:mod:`~miserver.services.inference.upstream_rows` with :data:`RELAY`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...engines.base import Engine
from ...engines.upstream import UpstreamPool
from ...errors import APIError, UnsupportedParameterError, UnsupportedValueError
from ...ids import random_id
from ...protocol.anthropic import CountTokensRequest, MessagesRequest, MessageTokensCount
from ...protocol.parsing import carried_fields, parse_request
from . import chat, routing
from .chat import Extras
from .context import Call, ServiceContext, ServiceResult, StreamResult
from .messages_chat import chat_body, message
from .messages_stream import events
from .upstream_rows import Relay

#: Fields of Anthropic's Messages API that ask for what this server lacks (refused when carried, unless neutral:
#: ``thinking`` disabled, an empty ``mcp_servers``, ``service_tier`` ``auto`` or ``standard_only``, ``speed``
#: ``standard``).
UNSUPPORTED_FIELDS = (
    "thinking",
    "mcp_servers",
    "container",
    "context_management",
    "service_tier",
    "output_format",
    "output_config",
    "diagnostics",
    "inference_geo",
    "speed",
)
NEUTRAL_SERVICE_TIERS = ("auto", "standard_only")
#: Chat's field names (as an error from the chat service names them) -> the Messages field they come from.
CHAT_PARAMS = (
    ("messages", "messages"),
    ("tool_choice", "tool_choice"),
    ("tools", "tools"),
    ("max_completion_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
)


def _neutral(name: str, value: Any) -> bool:
    if name == "mcp_servers":
        return not value
    if name == "thinking":
        return isinstance(value, dict) and value.get("type") == "disabled" and len(value) == 1
    if name == "service_tier":
        return bool(value in NEUTRAL_SERVICE_TIERS)
    if name == "speed":
        return bool(value == "standard")
    return False


def _from_chat(exc: APIError) -> APIError:
    """A chat service error with its ``param`` named as the Messages request names it."""
    for prefix, name in CHAT_PARAMS:
        if exc.param is not None and exc.param.startswith(prefix):
            exc.param = name
            break
    return exc


def parse(body: Any, *, strict: bool) -> MessagesRequest:
    """The checks of a Messages body that need no model (a model served upstream gets these, then goes there as
    the equivalent chat request).

    Raises :class:`~miserver.errors.APIError` (400) naming the field: the schema, unknown (strict) and unsupported
    fields, a final ``assistant`` turn (a prefill, which this server does not continue), the block and tool rules of
    :func:`~miserver.services.inference.messages_chat.chat_body`.
    """
    req = parse_request(MessagesRequest, body, strict=strict)
    for name, value in carried_fields(req, UNSUPPORTED_FIELDS).items():
        if value is not None and not _neutral(name, value):
            raise UnsupportedParameterError(
                f"Unsupported parameter: '{name}' is not supported by this server.", param=name
            )
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise UnsupportedValueError(
            f"Invalid value for 'messages[{last}].role': the last message is an 'assistant' turn (a prefill to "
            "continue), which this server does not support; end with a 'user' turn.",
            param=f"messages[{last}].role",
        )
    translated, _extras = chat_body(req)
    try:
        chat.parse(translated, strict=True)
    except APIError as exc:
        raise _from_chat(exc) from None
    return req


def check_local(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[MessagesRequest, Engine]:
    """:func:`parse`, then the chat service's checks of the equivalent chat body on the resident engine (model
    resolution, the forced tool call's grammar compiled). Raises 400 as :func:`parse` and the chat service do,
    404 ``model_not_found``."""
    req = parse(body, strict=strict)
    try:
        _chat_req, engine = chat.check_local(ctx, chat_body(req)[0], strict=True)
    except APIError as exc:
        raise _from_chat(exc) from None
    return req, engine


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[MessagesRequest, Engine | UpstreamPool]:
    """Parse and check a Messages body without running it (batch validation calls this): :func:`check_local`, or,
    for a model served by an upstream pool, :func:`parse` and the upstream context check (returns the pool)."""
    return routing.route_check(ctx, body, strict, parse, check_local)


def count_tokens(ctx: ServiceContext, body: Any, *, strict: bool) -> dict[str, int]:
    """``POST /anthropic/v1/messages/count_tokens``: ``{"input_tokens": n}``, the prompt's tokens exactly as a
    Messages request with this ``model``, ``system``, ``messages``, ``tools`` and ``tool_choice`` would count them
    (the chat template and the tool prompt included). Raises 400 for the schema, unknown (strict) and unsupported
    fields and 404 ``model_not_found``, as :func:`check_local` does, and 400 ``unsupported_value`` on ``model`` for a
    model served upstream (its tokenizer is not here); nothing runs on the engine."""
    asked = parse_request(CountTokensRequest, body, strict=strict)  # a dict, its fields known (or ignored: not strict)
    pool = routing.target(ctx, body)
    if pool is not None:
        names = ", ".join(f"'{u.name}'" for u in pool.members)
        raise UnsupportedValueError(
            f"The model '{asked.model}' is served by upstream {names}: its tokenizer is not here, so its prompts "
            "cannot be counted (upstreams do not count tokens). A Messages request to it reports its "
            "'usage.input_tokens'.",
            param="model",
        )
    prompt = {name: value for name, value in body.items() if name in CountTokensRequest.model_fields}
    req, _engine = check_local(ctx, {**prompt, "max_tokens": 1}, strict=True)
    translated, extras = chat_body(req)
    try:
        prepared = chat.prepare(ctx, translated, Call(strict=True), extras)
    except APIError as exc:
        raise _from_chat(exc) from None
    return MessageTokensCount(input_tokens=len(prepared.gen.prompt_ids)).model_dump()


def _answer(result: ServiceResult, extras: Extras) -> ServiceResult:
    """The Message result of a chat completion result (its headers and usage kept)."""
    upstream = f"'{result.headers.get('X-miLLM-Backend', '')}'"
    answer = message(result.body, random_id("msg_"), extras, upstream)
    return ServiceResult(200, answer.model_dump(), result.headers, result.prompt_tokens, result.completion_tokens)


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Run a Messages request through the chat service: a :class:`ServiceResult` with the Message, or, when
    ``stream`` is true, a :class:`StreamResult` whose events are whole Server-Sent Events frames (``event:
    <type>\\ndata: <json>``). Raises :class:`~miserver.errors.APIError` as :func:`check` and the chat service do
    (a chat field named as the Messages field it comes from)."""
    req, _target = check(ctx, body, strict=call.strict)
    translated, extras = chat_body(req)
    try:
        result = await chat.create(ctx, translated, dataclasses.replace(call, strict=True), extras)
    except APIError as exc:
        raise _from_chat(exc) from None
    if isinstance(result, StreamResult):
        model = result.headers.get("X-miLLM-Model", req.model)
        # the chat stream's own counts (result.usage) bill this stream, also when its client goes away midway
        return StreamResult(events(result, random_id("msg_"), model, extras), result.headers, result.usage)
    return _answer(result, extras)


def _relayed_body(req: MessagesRequest) -> dict[str, Any]:
    translated, extras = chat_body(req)
    return extras.relayed(translated)


def _relayed_answer(req: MessagesRequest, result: ServiceResult) -> ServiceResult:
    return _answer(result, chat_body(req)[1])


#: How a batch row naming an upstream model travels: as its chat request, answered as a Message.
RELAY = Relay("/v1/chat/completions", _relayed_body, _relayed_answer)
