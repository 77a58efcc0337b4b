"""OpenAI's Responses stream events over a chat service stream of chunks (the resident engine's, or an upstream's as
relayed): one translation for both.

Output items are streamed one after the other, each closed before the next opens, as OpenAI streams them: text
deltas open a ``message`` item, a chat tool-call delta with a new ``index`` opens a ``function_call`` item whose
``arguments`` grow by the deltas that follow (whole in one delta from the resident engine, piece by piece from most
upstreams).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ...errors import APIError
from ...ids import random_id
from ...protocol.responses import OutputMessage, OutputText
from .context import StreamResult
from .responses_items import function_call_item

#: The finished Response object from its output items, the chat finish reason and the chat usage (or None).
Build = Callable[[list[dict[str, Any]], str, dict[str, Any] | None], dict[str, Any]]
#: Keeps a finished Response (None: ``store`` false).
Save = Callable[[dict[str, Any]], Awaitable[None]]


class _Items:
    """The output items of a stream: those finished, and the one open (its events go through ``event``)."""

    def __init__(self, event: Callable[..., str], message_id: str) -> None:
        self.event = event
        self.message_id = message_id
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    @property
    def index(self) -> int:
        return len(self.done)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.index}

    def open_message(self) -> list[str]:
        """Open the message item (closing the open function call, if any), unless it is open."""
        if self.open is not None and self.open["type"] == "message":
            return []
        out = self.close("completed")
        used = any(item["id"] == self.message_id for item in self.done)
        item_id = random_id("msg_") if used else self.message_id
        self.open = OutputMessage(id=item_id, status="in_progress", content=[]).model_dump()
        self.text = []
        out.append(self.event("response.output_item.added", output_index=self.index, item=self.open))
        part = OutputText(text="").model_dump()
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def text_delta(self, delta: str) -> list[str]:
        out = self.open_message()
        self.text.append(delta)
        out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=[]))
        return out

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self.close("completed")
            call_id = str(call.get("id") or random_id("call_"))
            item = function_call_item(call_id, str(function.get("name") or ""), "", "in_progress")
            self.calls[index], self.open = item, item
            out.append(self.event("response.output_item.added", output_index=self.index, item=item))
        elif function.get("name") and not item["name"]:
            item["name"] = str(function["name"])
        arguments = function.get("arguments")
        if arguments and item is self.open:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out

    def close(self, status: str) -> list[str]:
        """Close the open item (if any) with ``status``."""
        item, out = self.open, list[str]()
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            text = "".join(self.text)
            part = OutputText(text=text).model_dump()
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = OutputMessage(id=item["id"], status=status, content=[OutputText(text=text)]).model_dump()  # type: ignore[arg-type]
        else:
            item = {**item, "status": status}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.done.append(item)
        self.open = None
        return out


async def events(
    chat_stream: StreamResult, started: dict[str, Any], message_id: str, build: Build, save: Save | None
) -> AsyncIterator[str]:
    """OpenAI's Responses event sequence: ``response.created``, ``response.in_progress``, then each output item
    (``response.output_item.added``; a message's ``response.content_part.added``, ``response.output_text.delta``...,
    ``response.output_text.done``, ``response.content_part.done``; a function call's
    ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``;
    ``response.output_item.done``), then ``response.completed`` (or ``response.incomplete``: the chat finish reason
    ``length``). ``started`` is the Response in progress; every event is JSON text with its ``type`` and
    ``sequence_number``. An answer with no text and no call is one empty message. A failure while generating (an
    :class:`~miserver.errors.APIError`, or an error chunk of a relayed stream) ends the stream with an ``error``
    event; nothing is saved then."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        payload = json.dumps({"type": kind, "sequence_number": sequence, **fields})
        sequence += 1
        return payload

    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    items = _Items(event, message_id)
    finish_reason = "stop"
    usage: dict[str, Any] | None = None
    try:
        async for payload in chat_stream.events:
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            error = chunk.get("error") if isinstance(chunk, dict) else None
            if isinstance(error, dict):
                yield event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for out in items.text_delta(delta["content"]):
                        yield out
                for call in delta.get("tool_calls") or []:
                    for out in items.call_delta(call):
                        yield out
                finish_reason = choice.get("finish_reason") or finish_reason
    except APIError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
        return
    finally:  # a client gone mid-stream closes this generator: the chat stream frees its admission slot now
        close = getattr(chat_stream.events, "aclose", None)
        if close is not None:
            await close()
    status = "incomplete" if finish_reason == "length" else "completed"
    if items.open is None and not items.done:
        for out in items.open_message():
            yield out
    for out in items.close(status):
        yield out
    final = build(items.done, finish_reason, usage)
    if save is not None:
        await save(final)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)
