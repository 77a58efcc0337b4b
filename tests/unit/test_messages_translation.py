"""The translation of Anthropic's Messages API into chat and back (``services/inference/messages_chat.py``,
``messages_stream.py``): turns and tools as chat's, a chat completion as a Message, a chat stream (the resident
engine's, and an upstream's with a tool call in pieces) as Anthropic's events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from miserver.errors import APIError
from miserver.services.inference import messages, messages_chat
from miserver.services.inference.chat import Extras
from miserver.services.inference.context import StreamResult, StreamUsage
from miserver.services.inference.messages_stream import events

MODEL = "tiny"
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "f", "description": "Weather of a city", "input_schema": OBJECT}
#: a user turn, then the assistant's call of ``f``
CALLED: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}},
        ],
    },
]
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_tools_translation() -> None:
    """tools, tool_choice, tool_use and tool_result blocks as chat's tools, tool_choice, tool_calls and tool turns."""
    result = RESULT | {"content": [{"type": "text", "text": "18 C"}], "is_error": False}
    failed = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout", "is_error": True}
    turns = [*CALLED, {"role": "user", "content": [result, failed, {"type": "text", "text": "And now?"}]}]
    for choice, chat_choice in (
        ({"type": "any", "disable_parallel_tool_use": True}, "required"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
    ):
        req = messages.parse(body(tools=[TOOL], tool_choice=choice, messages=turns), strict=True)
        translated, _extras = messages_chat.chat_body(req)
        assert translated["tool_choice"] == chat_choice
    assert translated["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "Weather of a city", "parameters": OBJECT}}
    ]
    call = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    assert translated["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"},
        {"role": "user", "content": "And now?"},
    ]


def test_answer_translation() -> None:
    """A chat completion's tool call as a tool_use block (toolu_ id, input object), its finish reason as stop_reason;
    the stop sequence that ended it from the resident engine's report or from an upstream's choice."""
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    call = {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"city": "Rome"}'}}
    said = {"role": "assistant", "content": None, "tool_calls": [call]}
    completion = {
        "model": "m",
        "choices": [{"index": 0, "message": said, "finish_reason": "tool_calls"}],
        "usage": usage,
    }
    m = messages_chat.message(completion, "msg_1", Extras())
    assert [b.model_dump() for b in m.content] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"city": "Rome"}}
    ]
    assert (m.stop_reason, m.stop_sequence, m.usage.input_tokens, m.usage.output_tokens) == ("tool_use", None, 9, 4)
    text = {"role": "assistant", "content": "Hi"}
    upstream = {"model": "m", "choices": [{"index": 0, "message": text, "finish_reason": "stop", "stop_reason": "!"}]}
    m = messages_chat.message(upstream | {"usage": usage}, "msg_2", Extras(stop=("!",)))
    assert (m.content[0].model_dump(), m.stop_reason, m.stop_sequence) == (
        {"type": "text", "text": "Hi"},
        "stop_sequence",
        "!",
    )
    resident = Extras(stop=("?",), matched={0: "?"})
    assert messages_chat.message(upstream | {"usage": usage}, "msg_3", resident).stop_sequence == "?"
    bad = dict(
        completion,
        choices=[
            {
                "index": 0,
                "message": said | {"tool_calls": [call | {"function": {"name": "f", "arguments": "[1]"}}]},
                "finish_reason": "tool_calls",
            }
        ],
    )
    with pytest.raises(APIError) as info:
        messages_chat.message(bad, "msg_4", Extras(), "'a'")
    assert (info.value.status_code, info.value.code) == (502, "upstream_bad_response")
    with pytest.raises(APIError) as info:
        messages_chat.message({"model": "m", "choices": []}, "msg_5", Extras(), "'a'")
    assert (info.value.status_code, info.value.code) == (502, "upstream_bad_response")


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [
        ("length", None, "max_tokens"),
        ("stop", None, "end_turn"),
        ("stop", "\n", "stop_sequence"),
        ("tool_calls", None, "tool_use"),
        ("content_filter", None, "refusal"),
    ],
)
def test_stop_reason(finish: Any, stop: str | None, reason: str) -> None:
    assert messages_chat.stop_reason(finish, stop) == reason


# -- streams -----------------------------------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]})


async def run(payloads: list[str], extras: Extras | None = None, prompt_tokens: int = 7) -> list[dict[str, Any]]:
    """The events (type and data) of the Messages stream over chat chunks ``payloads``."""

    async def chat_events() -> AsyncIterator[str]:
        for payload in payloads:
            yield payload

    usage = StreamUsage()
    usage.progress(prompt_tokens, 0)
    frames = [f async for f in events(StreamResult(chat_events(), {}, usage), "msg_1", MODEL, extras or Extras())]
    out = []
    for f in frames:
        name, data = f.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


USAGE = json.dumps(
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}
)


async def test_a_text_stream() -> None:
    """Text deltas in one text block; the matched stop sequence (the resident engine's report) in message_delta."""
    payloads = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"})]
    payloads += [chunk({}, "stop"), USAGE, "[DONE]"]
    got = await run(payloads, Extras(stop=("!",), matched={0: "!"}))
    assert [e["type"] for e in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0]["message"]["usage"]["input_tokens"] == 7  # known when the first token came
    assert "".join(e["delta"]["text"] for e in got if e["type"] == "content_block_delta") == "Hello"
    assert got[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "!"}
    zero_cache = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert got[-2]["usage"] == {"input_tokens": 9, "output_tokens": 3, **zero_cache}
    assert {k: got[0]["message"]["usage"][k] for k in zero_cache} == zero_cache


async def test_an_upstream_tool_call_in_pieces() -> None:
    """vLLM streams a call's arguments in pieces: one tool_use block, its input as input_json_delta events."""
    first = {"index": 0, "id": "chatcmpl-tool-9", "type": "function", "function": {"name": "f", "arguments": ""}}
    payloads = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [first]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}),
        chunk({}, "tool_calls"),
        USAGE,
        "[DONE]",
    ]
    got = await run(payloads)
    starts = [e for e in got if e["type"] == "content_block_start"]
    assert [s["content_block"] for s in starts] == [
        {"type": "tool_use", "id": "toolu_chatcmpl-tool-9", "name": "f", "input": {}}
    ]
    pieces = [e["delta"]["partial_json"] for e in got if e["type"] == "content_block_delta"]
    assert json.loads("".join(pieces)) == {"city": "Rome"}
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-1]["type"] == "message_stop"


async def test_text_then_a_call_and_an_error_chunk() -> None:
    """Text then a call are two blocks (indices 0 and 1); an error chunk ends the stream with an error event."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    got = await run([chunk({"content": "Sure."}), chunk({"tool_calls": [call]}), chunk({}, "stop"), "[DONE]"])
    blocks = [(e["index"], e["content_block"]["type"]) for e in got if e["type"] == "content_block_start"]
    assert blocks == [(0, "text"), (1, "tool_use")]
    assert [e["index"] for e in got if e["type"] == "content_block_stop"] == [0, 1]
    assert got[-2]["delta"]["stop_reason"] == "tool_use"
    cut = json.dumps({"error": {"message": "The upstream 'a' closed the stream.", "type": "server_error"}})
    got = await run([chunk({"content": "Hi"}), cut])
    assert got[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "The upstream 'a' closed the stream."},
    }
