"""A chat completion stream as Anthropic's Messages stream: the chat service's chunks (the resident engine's or an
upstream's, relayed) translated into Anthropic's Server-Sent Events.

The events: ``message_start`` (the Message with no content; ``usage.input_tokens`` the prompt's tokens as known
when the first token comes: exact on the resident engine, a lower bound for an upstream, whose count comes in
``message_delta``), then per content block ``content_block_start``, its deltas and ``content_block_stop``: a ``text``
block (``text_delta`` events), and for each tool call a ``tool_use`` block that starts with ``input: {}`` and gets its
input as ``input_json_delta`` events (``partial_json``; joined they are the input's JSON), then ``message_delta``
(``stop_reason``, ``stop_sequence``, the final ``usage``) and ``message_stop``. An error chunk, or a failure, ends
the stream with an ``error`` event in Anthropic's envelope.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from ...errors import SERVER_ERROR_MESSAGE, ServerError
from ...protocol.anthropic import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    TextBlock,
    TextDelta,
    ToolUseBlock,
)
from .chat import Extras
from .context import StreamResult
from .messages_chat import matched_stop, stop_reason, tool_use_id

log = logging.getLogger("miserver.services")


def frame(event: BaseModel | dict[str, Any]) -> str:
    """One Server-Sent Event: ``event: <type>`` and ``data: <json>``."""
    payload = event.model_dump() if isinstance(event, BaseModel) else event
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}"


def _error_frame(error: Any) -> str:
    """The ``error`` event of a chunk's OpenAI error object (an upstream's error, or its stream cut)."""
    message = error.get("message") if isinstance(error, dict) else None
    return frame({"type": "error", "error": {"type": "api_error", "message": str(message or error)}})


def _meaningful(chunk: dict[str, Any], choices: list[dict[str, Any]]) -> bool:
    """Whether a chunk says more than the role: usage, content, a tool call or a finish reason."""
    if chunk.get("usage"):
        return True
    for c in choices:
        delta = c.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or c.get("finish_reason"):
            return True
    return False


class _Blocks:
    """The content blocks of the answer as they are streamed: which is open, and the next index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text", or "tool:<chat index>" of the tool call whose block is open
        self.any = False
        self.called = False

    def start(self, kind: str, block: TextBlock | ToolUseBlock) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open, self.any = kind, True
        self.called |= kind != "text"
        return [*out, frame(ContentBlockStartEvent(index=self.index, content_block=block))]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [frame(ContentBlockStopEvent(index=self.index))]


def _deltas(choice: dict[str, Any], blocks: _Blocks) -> list[str]:
    """The events of one chunk's choice: text, then tool call pieces (a call whose ``id`` comes starts its block)."""
    out: list[str] = []
    delta = choice.get("delta") or {}
    text = delta.get("content")
    if text:
        if blocks.open != "text":
            out += blocks.start("text", TextBlock(text=""))
        out.append(frame(ContentBlockDeltaEvent(index=blocks.index, delta=TextDelta(text=text))))
    for call in delta.get("tool_calls") or []:
        key = f"tool:{call.get('index', 0)}"
        function = call.get("function") or {}
        if blocks.open != key:
            block = ToolUseBlock(id=tool_use_id(call.get("id")), name=str(function.get("name") or ""), input={})
            out += blocks.start(key, block)
        arguments = function.get("arguments")
        if arguments:
            out.append(frame(ContentBlockDeltaEvent(index=blocks.index, delta=InputJsonDelta(partial_json=arguments))))
    return out


async def events(chat_stream: StreamResult, message_id: str, model: str, extras: Extras) -> AsyncIterator[str]:
    """Anthropic's events over ``chat_stream`` (chat chunks as JSON text, ending with ``[DONE]``). Closing this
    iterator closes the chat stream (its admission slot is freed at once)."""
    usage: dict[str, Any] = {}
    finish: str | None = None
    stop: str | None = None
    blocks = _Blocks()
    started = False

    def start() -> str:
        tokens = int(usage.get("prompt_tokens") or chat_stream.usage.prompt_tokens)
        empty = Message(
            id=message_id,
            content=[],
            model=model,
            stop_reason=None,
            stop_sequence=None,
            usage=MessageUsage(input_tokens=tokens, output_tokens=0),
        )
        return frame(MessageStartEvent(message=empty))

    try:
        async for payload in chat_stream.events:
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                yield _error_frame(chunk["error"])
                return
            usage = chunk.get("usage") or usage
            choices = [c for c in chunk.get("choices") or [] if c.get("index", 0) == 0]
            if not started and _meaningful(chunk, choices):
                started = True
                yield start()
            for choice in choices:
                for event in _deltas(choice, blocks):
                    yield event
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                    stop = matched_stop(choice, extras) if finish == "stop" else None
    except Exception:
        log.exception("a streamed message failed")
        yield frame(ServerError(SERVER_ERROR_MESSAGE).anthropic_envelope())
        return
    finally:  # a client gone mid-stream closes this generator: the chat stream frees its slot now
        close = getattr(chat_stream.events, "aclose", None)
        if close is not None:
            await close()
    if not started:
        yield start()
    if not blocks.any:
        for event in blocks.start("text", TextBlock(text="")):
            yield event
    for event in blocks.stop():
        yield event
    if blocks.called:
        finish, stop = "tool_calls", None
    final = MessageDeltaUsage(
        input_tokens=int(usage.get("prompt_tokens") or chat_stream.usage.prompt_tokens),
        output_tokens=int(usage.get("completion_tokens") or chat_stream.usage.completion_tokens),
    )
    delta = MessageDelta(stop_reason=stop_reason(finish, stop), stop_sequence=stop)
    yield frame(MessageDeltaEvent(delta=delta, usage=final))
    yield frame(MessageStopEvent())
