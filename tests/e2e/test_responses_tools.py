"""Function tools on ``POST /v1/responses`` on the real embedded model (SmolLM2-135M-Instruct), with the official SDK
in strict response validation: a forced call is a ``function_call`` output item with valid arguments; its result,
fed back through ``input`` or through ``previous_response_id``, gives the text the equivalent chat conversation
gives; the stream's argument deltas assemble the call; the SDK's ``responses.parse`` reads the call's arguments
into a pydantic object; a batch of Responses lines with tools answers as the route does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.batches import jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, real_model_server

pytestmark = pytest.mark.slow

MODEL = EMBEDDED_MODEL_ID
URL = "/v1/responses"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": PARAMETERS,
    "strict": True,
}
ASK = "What is the weather in Paris?"
RESULT = '{"temperature_c": 18}'


class GetWeather(BaseModel):
    """Current weather of a city"""

    city: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("responses-tools")
    proc = real_model_server(tmp)
    with proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client(timeout=120.0)


def forced(client: openai.OpenAI, **extra: Any) -> Any:
    return client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
        **extra,
    )


def test_a_forced_call_is_a_function_call_item(client: openai.OpenAI) -> None:
    choices: list[Any] = ["required", {"type": "function", "name": "get_weather"}]
    for choice in choices:
        r = client.responses.create(
            model=MODEL,
            input=ASK,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,
            parallel_tool_calls=False,
            max_output_tokens=40,
            temperature=0,
        )
        assert r.status == "completed" and len(r.output) == 1, r.output
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.id is not None and call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert set(json.loads(call.arguments)) == {"city"}
        assert r.output_text == ""
        assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.model_dump() == choice  # type: ignore[union-attr]
        assert r.parallel_tool_calls is False
        assert [t.model_dump(exclude_none=True) for t in r.tools] == [WEATHER]


def test_the_call_and_its_result_go_back_through_input_or_previous_response_id(client: openai.OpenAI) -> None:
    first = forced(client)
    (call,) = first.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    turn: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 20, "temperature": 0}
    sent_back = [{"role": "user", "content": ASK}, *first.output, result]  # the SDK's item sent back as it came
    via_input = client.responses.create(model=MODEL, input=sent_back, **turn)  # type: ignore[arg-type]
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], **turn)  # type: ignore[list-item]
    assert via_input.output[0].type == chained.output[0].type == "message"
    assert via_input.output_text and via_input.output_text == chained.output_text
    # the same conversation as chat turns gives the same text: one translation
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.call_id, "content": RESULT},
        ],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    )
    assert chat.choices[0].message.content == chained.output_text
    # the stored chain keeps the call: the input items list it with OpenAI's shapes, newest first
    items = client.responses.input_items.list(chained.id).data
    assert [i.type for i in items] == ["function_call_output", "function_call", "message"]
    assert items[0].call_id == items[1].call_id == call.call_id  # type: ignore[union-attr]
    assert items[1].id == call.id and items[1].arguments == call.arguments  # type: ignore[union-attr]


def test_a_result_of_no_earlier_call_is_refused(client: openai.OpenAI) -> None:
    result = {"type": "function_call_output", "call_id": "call_nobody", "output": RESULT}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, result], tools=[WEATHER])  # type: ignore[list-item]
    assert caught.value.body["param"] == "input[1].call_id"  # type: ignore[index]


def test_streamed_argument_deltas_assemble_the_call(client: openai.OpenAI) -> None:
    whole = forced(client, store=False)
    events = list(forced(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    assert added.item.type == "function_call" and added.item.status == "in_progress"  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert deltas == done.arguments == item_done.item.arguments == whole.output[0].arguments  # type: ignore[union-attr]
    assert set(json.loads(deltas)) == {"city"}
    assert done.item_id == added.item.id == item_done.item.id  # type: ignore[union-attr]
    assert completed.response.output[0].model_dump() == item_done.item.model_dump()  # type: ignore[union-attr]
    with client.responses.stream(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=40, temperature=0
    ) as stream:  # type: ignore[call-overload]
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].arguments == deltas


def test_the_sdks_parse_helper_reads_the_call(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL,
        input=ASK,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = parsed.output
    assert call.type == "function_call" and isinstance(call.parsed_arguments, GetWeather)  # type: ignore[union-attr]


def test_a_batch_with_tools_answers_as_the_route(client: openai.OpenAI) -> None:
    cities = ["Paris", "Rome", "Oslo"]
    bodies = [
        {
            "model": MODEL,
            "input": f"What is the weather in {city}?",
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_output_tokens": 40,
            "temperature": 0,
            "store": False,
        }
        for city in cities
    ]
    done = wait_terminal(
        client,
        submit(client, jsonl(line(f"t-{i}", b, url=URL) for i, b in enumerate(bodies)), endpoint=URL).id,
        timeout=600,
    )
    assert done.status == "completed", done
    out = {o["custom_id"]: o["response"]["body"] for o in read_lines(client, done.output_file_id)}
    assert sorted(out) == ["t-0", "t-1", "t-2"]
    for i, body in enumerate(bodies):
        (call,) = out[f"t-{i}"]["output"]
        sync = client.responses.create(**body).output[0]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert call["arguments"] == sync.arguments and set(json.loads(call["arguments"])) == {"city"}  # type: ignore[union-attr]
        assert out[f"t-{i}"]["tools"] == [WEATHER] and out[f"t-{i}"]["tool_choice"] == "required"
