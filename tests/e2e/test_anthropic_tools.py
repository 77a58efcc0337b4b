"""Client tools on Anthropic's Messages API, on the real embedded model (SmolLM2-135M-Instruct), driven by the official
``anthropic`` SDK in strict response validation.

A call forced by ``tool_choice`` (``any``, or ``tool`` naming it) is a ``tool_use`` block whose input follows the
tool's ``input_schema``, with ``stop_reason: "tool_use"``; its result fed back as a ``tool_result`` block gets a
text answer, the same text as the equivalent chat request; streamed, the call is a ``tool_use`` block whose
``input_json_delta`` pieces join into its input; a Message Batch of tool requests gives the synchronous calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.server import ServerProcess, real_model_server, wait_for

pytestmark = pytest.mark.slow

MODEL = EMBEDDED_MODEL_ID
GREEDY = {"temperature": 0.0}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {"name": "get_weather", "description": "Current weather of a city", "input_schema": SCHEMA}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("anthropic-tools")
    proc = real_model_server(tmp)
    with proc:
        yield proc


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(
        base_url=server.base_url + "/anthropic",
        api_key="test",
        _strict_response_validation=True,
        max_retries=0,
        timeout=120.0,
    )
    with client:
        yield client


def the_call(message: Any) -> Any:
    """The one ``tool_use`` block of a Message that called a tool, checked against the tool's schema."""
    assert message.stop_reason == "tool_use" and message.stop_sequence is None, message
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    assert set(block.input) == {"city"} and isinstance(block.input["city"], str), block.input
    return block


def test_a_forced_call_is_a_tool_use_block(claude: anthropic.Anthropic) -> None:
    choices: list[Any] = [
        {"type": "any"},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ]
    for choice in choices:
        m = claude.messages.create(
            model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], tool_choice=choice, extra_body=GREEDY
        )
        the_call(m)
        assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choices[0])
    assert counted.input_tokens == m.usage.input_tokens


def test_a_tool_result_fed_back_gets_a_text_answer(claude: anthropic.Anthropic, server: ServerProcess) -> None:
    """The round trip; the final answer is the text of the equivalent chat request (one inference path)."""
    first = claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    )
    call = the_call(first)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, sunny"}]}
    turns: Any = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    final = claude.messages.create(
        model=MODEL, max_tokens=24, messages=turns, tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY
    )
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    text = final.content[0].text  # type: ignore[union-attr]
    assert text
    chat_tool = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"]}}
    chat_tool["function"]["parameters"] = SCHEMA  # type: ignore[index]
    arguments = json.dumps(call.input)
    chat_turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    chat = server.client(timeout=120.0).chat.completions.create(
        model=MODEL,
        messages=chat_turns,  # type: ignore[arg-type]
        tools=[chat_tool],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == final.usage.input_tokens


def test_a_streamed_call_assembles_its_input(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    )
    kinds, pieces, started = [], [], []
    with claude.messages.stream(
        model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_start":
                started.append(event.content_block)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    (block,) = started
    assert block.type == "tool_use" and block.input == {} and block.name == "get_weather"
    assert pieces and json.loads("".join(pieces)) == the_call(whole).input
    assert the_call(final).input == the_call(whole).input
    assert (
        final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == whole.usage.output_tokens
    )


def test_a_message_batch_with_tools(claude: anthropic.Anthropic) -> None:
    cities = ["Paris", "Rome", "Oslo"]
    params = [
        {
            "model": MODEL,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
            "temperature": 0.0,
        }
        for city in cities
    ]
    requests: Any = [{"custom_id": f"w-{i}", "params": p} for i, p in enumerate(params)]
    created = claude.messages.batches.create(requests=requests)
    wait_for(lambda: claude.messages.batches.retrieve(created.id).processing_status == "ended", timeout=600)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(created.id)}
    assert set(results) == {f"w-{i}" for i in range(len(cities))}
    for i, p in enumerate(params):
        result = results[f"w-{i}"]
        assert result.type == "succeeded", result
        sync = claude.messages.create(**{k: v for k, v in p.items() if k != "temperature"}, extra_body=GREEDY)
        assert the_call(result.message).input == the_call(sync).input
        assert result.message.usage == sync.usage
