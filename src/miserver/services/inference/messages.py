"""``POST /anthropic/v1/messages`` (Anthropic's Messages API), translated into the chat service: one inference path.

A Messages body is checked here (its own schema and refusals), then written as the equivalent chat body (``system``
as a system turn, text blocks joined, ``max_tokens``, ``temperature``, ``top_p``) and prepared by
:func:`miserver.services.inference.chat.prepare`: the same model resolution, tokenisation, context check, seed and
provenance
headers as a chat request. ``stop_sequences`` (any number) and ``top_k`` go into the sampling parameters of that
prepared request; :func:`miserver.services.inference.chat.run_prepared` runs it under the admission gate. So a Messages
request and the equivalent chat request produce the same text at temperature 0.

The answer is Anthropic's Message; a stream is Anthropic's event sequence (``message_start``,
``content_block_start``, ``content_block_delta``..., ``content_block_stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from ...engines.adapter import normalise_stop
from ...engines.base import Engine, FinishReason, GenerationResult
from ...errors import SERVER_ERROR_MESSAGE, ServerError, UnsupportedParameterError, UnsupportedValueError
from ...ids import random_id
from ...protocol.anthropic import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageTokensCount,
    MessageUsage,
    StopReason,
    TextBlock,
    TextBlockParam,
    TextDelta,
    blocks_text,
)
from ...protocol.parsing import carried_fields, parse_request
from . import chat
from .context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage

log = logging.getLogger("miserver.services")

#: Fields of Anthropic's Messages API that ask for what the resident engine lacks (refused when carried, unless
#: neutral: an empty tool list, ``tool_choice`` ``none``/``auto``, ``thinking`` disabled, ``service_tier`` ``auto``
#: or ``standard_only``, ``speed`` ``standard``).
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "thinking",
    "mcp_servers",
    "container",
    "context_management",
    "service_tier",
    "output_format",
    "output_config",
    "cache_control",
    "diagnostics",
    "inference_geo",
    "speed",
)
NEUTRAL_SERVICE_TIERS = ("auto", "standard_only")


def _neutral(name: str, value: Any) -> bool:
    if name in ("tools", "mcp_servers"):
        return not value
    if name == "tool_choice":
        return isinstance(value, dict) and value.get("type") in ("none", "auto") and len(value) == 1
    if name == "thinking":
        return isinstance(value, dict) and value.get("type") == "disabled" and len(value) == 1
    if name == "service_tier":
        return bool(value in NEUTRAL_SERVICE_TIERS)
    if name == "speed":
        return bool(value == "standard")
    return False


def _refuse_blocks(blocks: str | list[Any] | None, where: str) -> None:
    """400 ``unsupported_parameter`` for a text block's ``cache_control`` or ``citations`` (no prompt cache and no
    citations here: honouring neither, they are refused rather than ignored)."""
    if not isinstance(blocks, list):
        return
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlockParam):
            continue
        for name in ("cache_control", "citations"):
            if getattr(block, name) is not None:
                param = f"{where}[{j}].{name}"
                raise UnsupportedParameterError(
                    f"Unsupported parameter: '{param}' is not supported by this server (no prompt caching and no "
                    "citations); remove it.",
                    param=param,
                )


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[MessagesRequest, Engine]:
    """Parse and check a Messages body without running it (batch validation calls this too).

    Raises :class:`~miserver.errors.APIError`: 400 for the schema, unknown (strict) and unsupported fields, a final
    ``assistant`` turn (a prefill, which this server does not continue); 404 ``model_not_found``.
    """
    req = parse_request(MessagesRequest, body, strict=strict)
    for name, value in carried_fields(req, UNSUPPORTED_FIELDS).items():
        if value is not None and not _neutral(name, value):
            raise UnsupportedParameterError(
                f"Unsupported parameter: '{name}' is not supported by this server.", param=name
            )
    _refuse_blocks(req.system, "system")
    for i, message in enumerate(req.messages):
        _refuse_blocks(message.content, f"messages[{i}].content")
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise UnsupportedValueError(
            f"Invalid value for 'messages[{last}].role': the last message is an 'assistant' turn (a prefill to "
            "continue), which this server does not support; end with a 'user' turn.",
            param=f"messages[{last}].role",
        )
    return req, ctx.resolve_model(req.model)


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion body equivalent to ``req`` (without ``stop_sequences`` and ``top_k``, which go into the
    sampling parameters directly: Anthropic takes any number of stop sequences, and chat has no ``top_k``)."""
    turns: list[dict[str, str]] = []
    if req.system is not None:
        turns.append({"role": "system", "content": blocks_text(req.system)})
    turns.extend({"role": m.role, "content": m.text()} for m in req.messages)
    body: dict[str, Any] = {"model": req.model, "messages": turns, "max_tokens": req.max_tokens}
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    return body


def _prepare(ctx: ServiceContext, body: Any, call: Call) -> tuple[MessagesRequest, chat._Prepared]:
    """Check ``body``, then prepare its chat equivalent (raises ``APIError``); ``stop_sequences`` and ``top_k``
    set on the prepared sampling parameters."""
    req, _engine = check(ctx, body, strict=call.strict)
    p = chat.prepare(ctx, chat_body(req), dataclasses.replace(call, strict=True))
    params = dataclasses.replace(
        p.gen.params, stop=normalise_stop(req.stop_sequences), top_k=req.top_k if req.top_k else None
    )
    return req, dataclasses.replace(p, gen=dataclasses.replace(p.gen, params=params))


def count_tokens(ctx: ServiceContext, body: Any, *, strict: bool) -> dict[str, int]:
    """``POST /anthropic/v1/messages/count_tokens``: ``{"input_tokens": n}``, the prompt's tokens exactly as a
    Messages request with this ``model``, ``system`` and ``messages`` would count them (the chat template
    included). Raises 400 for the schema, unknown (strict) and unsupported fields and 404 ``model_not_found``, as
    :func:`check` does; nothing runs on the engine."""
    parse_request(CountTokensRequest, body, strict=strict)  # a dict, its fields known (or ignored: not strict)
    prompt = {name: value for name, value in body.items() if name in CountTokensRequest.model_fields}
    _req, p = _prepare(ctx, {**prompt, "max_tokens": 1}, Call(strict=True))
    return MessageTokensCount(input_tokens=len(p.gen.prompt_ids)).model_dump()


def stop_reason(finish_reason: FinishReason, stop_sequence: str | None) -> StopReason:
    """Anthropic's ``stop_reason`` of a finished sequence."""
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _message(message_id: str, model: str, result: GenerationResult) -> Message:
    seq = result.sequences[0]
    return Message(
        id=message_id,
        content=[TextBlock(text=seq.text)],
        model=model,
        stop_reason=stop_reason(seq.finish_reason, seq.stop_sequence),
        stop_sequence=seq.stop_sequence,
        usage=MessageUsage(input_tokens=result.prompt_tokens, output_tokens=result.completion_tokens),
    )


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Run a Messages request: a :class:`ServiceResult` with the Message, or, when ``stream`` is true, a
    :class:`StreamResult` whose events are whole Server-Sent Events frames (``event: <type>\\ndata: <json>``)."""
    req, p = _prepare(ctx, body, call)
    message_id = random_id("msg_")
    if req.stream:
        counted = StreamUsage()
        return StreamResult(_stream(ctx, p, call, message_id, counted), p.headers, counted)
    result = await chat.run_prepared(ctx, p, call)
    message = _message(message_id, p.engine.info.model_id, result)
    return ServiceResult(200, message.model_dump(), p.headers, result.prompt_tokens, result.completion_tokens)


def _frame(event: BaseModel) -> str:
    payload = event.model_dump()
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}"


async def _stream(
    ctx: ServiceContext, p: chat._Prepared, call: Call, message_id: str, counted: StreamUsage
) -> AsyncIterator[str]:
    model = p.engine.info.model_id
    prompt_tokens = len(p.gen.prompt_ids)
    start = Message(
        id=message_id,
        content=[],
        model=model,
        stop_reason=None,
        stop_sequence=None,
        usage=MessageUsage(input_tokens=prompt_tokens, output_tokens=0),
    )
    yield _frame(MessageStartEvent(message=start))
    yield _frame(ContentBlockStartEvent(index=0, content_block=TextBlock(text="")))
    output_tokens = 0
    reason: StopReason | None = None
    stop_sequence: str | None = None
    try:
        async with ctx.gate.hold(call.priority, call.slot):
            async for delta in p.engine.generate_stream(p.gen):
                output_tokens += delta.generated_tokens
                counted.progress(prompt_tokens, output_tokens)
                if delta.text:
                    yield _frame(ContentBlockDeltaEvent(index=0, delta=TextDelta(text=delta.text)))
                if delta.finish_reason is not None:
                    reason = stop_reason(delta.finish_reason, delta.stop_sequence)
                    stop_sequence = delta.stop_sequence
    except Exception:
        log.exception("a streamed message failed")
        error = ServerError(SERVER_ERROR_MESSAGE).anthropic_envelope()
        yield f"event: error\ndata: {json.dumps(error)}"
        return
    counted.set(prompt_tokens, output_tokens)
    yield _frame(ContentBlockStopEvent(index=0))
    usage = MessageDeltaUsage(output_tokens=output_tokens)
    yield _frame(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=stop_sequence), usage=usage))
    yield _frame(MessageStopEvent())
