"""The Responses API's translation into the chat service and back (``services.responses``), and its refusals."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import Response

from miserver.errors import APIError, ContextLengthError, ModelNotFoundError
from miserver.protocol.parsing import parse_request
from miserver.protocol.responses import ResponseCreateRequest
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference import responses, responses_stream
from miserver.services.inference.context import ServiceContext, StreamResult
from tests.support.fake_engine import MODEL, FakeEngine

TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]


def ctx() -> ServiceContext:
    return ServiceContext(engine=FakeEngine(), gate=AdmissionGate(1))


def request(**fields: Any) -> ResponseCreateRequest:
    return parse_request(ResponseCreateRequest, {"model": MODEL, "input": "Hi", **fields}, strict=True)


def refusal(body: dict[str, Any], *, strict: bool = True) -> APIError:
    with pytest.raises(APIError) as caught:
        responses.check(ctx(), {"model": MODEL, "input": "Hi", **body}, strict=strict)
    return caught.value


def test_a_string_input_is_one_user_turn() -> None:
    """``user``, ``safety_identifier`` and ``prompt_cache_key`` go into the chat request (accepted there without
    effect, relayed to an upstream as sent); ``metadata`` stays with the Response."""
    ids = {"user": "u", "safety_identifier": "5f2c0e", "prompt_cache_key": "tenant-7"}
    req = request(max_output_tokens=32, temperature=0.5, top_p=0.9, metadata={"a": "b"}, **ids)
    assert responses._chat_body(req, responses.input_turns(req, [])) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        **ids,
    }
    bare = request()
    assert not ids.keys() & responses._chat_body(bare, responses.input_turns(bare, [])).keys()


def test_instructions_first_then_earlier_turns_then_input() -> None:
    req = request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": [{"type": "output_text", "text": "c", "annotations": []}],
                "id": "msg_1",
                "status": "completed",
            },
        ],
        stream=True,
    )
    earlier = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "1"}]
    body = responses._chat_body(req, earlier + responses.input_turns(req, earlier))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        *earlier,
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "max_completion_tokens" not in body


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tools": [{"type": "function"}]}, "missing_required_parameter", "tools[0].name"),
        ({"tools": [{"type": "web_search"}]}, "unsupported_value", "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported_parameter", "tools[0].function"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "invalid_value", "tools[0].name"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "invalid_value",
            "tools[0].parameters",
        ),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "invalid_value", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "unsupported_value", "tool_choice.type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "invalid_value",
            "input[0].call_id",
        ),
        ({"reasoning": {"effort": "low"}}, "unsupported_parameter", "reasoning"),
        ({"background": True}, "unsupported_parameter", "background"),
        ({"include": ["reasoning.encrypted_content"]}, "unsupported_parameter", "include"),
        ({"conversation": "conv_1"}, "unsupported_parameter", "conversation"),
        ({"prompt": {"id": "p"}}, "unsupported_parameter", "prompt"),
        ({"top_logprobs": 3}, "unsupported_parameter", "top_logprobs"),
        ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
        ({"service_tier": "flex"}, "unsupported_parameter", "service_tier"),
        ({"stop": "x"}, "unsupported_parameter", "stop"),
        ({"text": {"format": {"type": "json_object"}}}, "unsupported_parameter", "text.format"),
        ({"text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity"),
        ({"text": {"format": {}}}, "invalid_value", "text.format.type"),
        ({"stream_options": {"include_obfuscation": False}}, "invalid_value", "stream_options"),
        ({"max_output_tokens": 15}, "invalid_value", "max_output_tokens"),
        ({"temperature": 3}, "invalid_value", "temperature"),
        ({"input": []}, "invalid_value", "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "unsupported_value",
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "invalid_value", "input[0].content[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            "invalid_value",
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "unsupported_value", "input[0].type"),
        ({"input": [{"type": "telepathy"}]}, "invalid_value", "input[0].type"),
        ({"input": [{"role": "user"}]}, "missing_required_parameter", "input[0].content"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
        ({"seed": 1}, "unknown_parameter", "seed"),
        ({"input": "\ud800"}, "invalid_value", "input"),
    ],
)
def test_refusals_name_the_parameter(body: dict[str, Any], code: str, param: str) -> None:
    error = refusal(body)
    assert (error.status_code, error.code, error.param) == (400, code, param), error.message


def test_neutral_values_pass_and_unknown_fields_pass_when_lenient() -> None:
    neutral = {
        "tools": [],
        "tool_choice": "none",
        "background": False,
        "include": [],
        "truncation": "disabled",
        "service_tier": "default",
        "reasoning": {"effort": None},
        "parallel_tool_calls": False,
        "store": False,
        "text": {"format": {"type": "text"}},
        "stream": True,
        "stream_options": {"include_obfuscation": False},
        "safety_identifier": "s",
        "prompt_cache_key": "k",
    }
    req, engine = responses.check(ctx(), {"model": MODEL, "input": "Hi", **neutral}, strict=True)
    assert engine.info.model_id == MODEL and req.store is False
    responses.check(ctx(), {"model": MODEL, "input": "Hi", "frobnicate": 1}, strict=False)
    assert isinstance(refusal({"tools": [{"type": "web_search"}]}, strict=False), APIError)


def test_unknown_model_is_the_chat_services_404() -> None:
    error = refusal({"model": "nope"})
    assert isinstance(error, ModelNotFoundError) and error.param == "model"


def test_chat_errors_on_messages_are_named_input() -> None:
    error = responses.from_chat(ContextLengthError("too long", param="messages"))
    assert isinstance(error, ContextLengthError) and error.param == "input" and error.code == "context_length_exceeded"
    other = ModelNotFoundError("x", param="model")
    assert responses.from_chat(other) is other


@pytest.mark.parametrize(("finish", "status"), [("stop", "completed"), ("length", "incomplete")])
def test_the_response_object_parses_with_the_sdk(finish: str, status: str) -> None:
    req = request(max_output_tokens=16, metadata={"a": "b"}, previous_response_id="resp_0")
    usage = {"prompt_tokens": 3, "completion_tokens": 16}
    output = responses.output_items({"content": "hello"}, "msg_1", status)
    body = responses._response(req, "resp_1", 100, MODEL, output, finish, usage)
    parsed = Response.model_validate(body)
    assert parsed.status == status and parsed.output_text == "hello" and parsed.previous_response_id == "resp_0"
    assert parsed.usage is not None and parsed.usage.total_tokens == 19
    assert (parsed.incomplete_details is not None) == (status == "incomplete")
    assert parsed.output[0].status == status  # type: ignore[union-attr]
    started = Response.model_validate(responses._response(req, "resp_1", 100, MODEL, None))
    assert started.status == "in_progress" and started.output == [] and started.usage is None


def _chat_stream(closed: list[bool], finish: str) -> StreamResult:
    async def events() -> AsyncIterator[str]:
        try:
            yield json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for piece in ("Hel", "lo"):
                yield json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]})
            yield json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            yield json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 16}})
            yield "[DONE]"
        finally:
            closed.append(True)

    return StreamResult(events(), {"X-miLLM-Model": MODEL})


async def _events(finish: str, *, take: int | None = None) -> tuple[list[dict[str, Any]], list[bool]]:
    closed: list[bool] = []
    req = request(store=False)

    def build(output: list[dict[str, Any]], finish: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return responses._response(req, "resp_1", 1, MODEL, output, finish, usage)

    started = responses._response(req, "resp_1", 1, MODEL, None)
    stream = responses_stream.events(_chat_stream(closed, finish), started, "msg_1", build, None)
    events = []
    async for payload in stream:
        events.append(json.loads(payload))
        if take is not None and len(events) == take:
            await stream.aclose()  # type: ignore[attr-defined]
            break
    return events, closed


@pytest.mark.parametrize(("finish", "last"), [("stop", "response.completed"), ("length", "response.incomplete")])
async def test_the_chat_stream_becomes_responses_events(finish: str, last: str) -> None:
    events, closed = await _events(finish)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.usage is not None and final.usage.output_tokens == 16
    assert events[-2]["item"] == events[-1]["response"]["output"][0]
    assert closed == [True]


async def test_a_stream_closed_early_closes_the_chat_stream() -> None:
    events, closed = await _events("stop", take=5)
    assert events[-1]["type"] == "response.output_text.delta"
    assert closed == [True], "the chat stream (and its admission slot) is released at once"


# -- function tools: items as chat turns, and a relayed stream's tool-call deltas -------------------------------------


def test_function_calls_and_results_are_chat_tool_calls_and_tool_turns() -> None:
    req = request(
        tools=TOOLS,
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        input=[
            {"role": "user", "content": "Go"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_1"},
            {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "one"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        ],
    )
    body = responses._chat_body(req, responses.input_turns(req, []))
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    assert body["messages"] == [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
    ]
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": TOOLS[0]["parameters"]}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False


def test_a_chat_answer_with_text_and_calls_is_a_message_then_function_call_items() -> None:
    message = {
        "content": "Calling.",
        "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    output = responses.output_items(message, "msg_1", "completed")
    body = Response.model_validate(responses._response(request(tools=TOOLS), "resp_1", 1, MODEL, output, "tool_calls"))
    assert [o.type for o in body.output] == ["message", "function_call"] and body.output_text == "Calling."
    call = body.output[1]
    assert call.call_id == "call_9" and call.id is not None and call.id.startswith("fc_")  # type: ignore[union-attr]
    assert responses.answer_turns(output)[1] == {
        "type": "function_call",
        "role": "assistant",
        "id": call.id,
        "call_id": "call_9",
        "name": "f",
        "arguments": '{"a": 1}',
    }


def _relayed(chunks: list[dict[str, Any]]) -> StreamResult:
    async def events() -> AsyncIterator[str]:
        for chunk in chunks:
            yield json.dumps(chunk)
        yield "[DONE]"

    return StreamResult(events(), {"X-miLLM-Model": MODEL})


async def _run(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    req = request(tools=TOOLS, store=False)

    def build(output: list[dict[str, Any]], finish: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return responses._response(req, "resp_1", 1, MODEL, output, finish, usage)

    started = responses._response(req, "resp_1", 1, MODEL, None)
    return [json.loads(e) async for e in responses_stream.events(_relayed(chunks), started, "msg_1", build, None)]


def _delta(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}], "usage": None}


async def test_a_relayed_stream_of_tool_call_pieces_becomes_function_call_events() -> None:
    """An upstream (vLLM's form) streams text, then each call's id and name, then its arguments piece by piece,
    ``usage: null`` on every chunk and the usage alone at the end: each item is closed before the next opens."""
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
    events = await _run(
        [
            _delta(role="assistant", content=""),
            _delta(content="Sure."),
            _delta(tool_calls=[first]),
            _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"x"'}}]),
            _delta(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
            _delta(tool_calls=[{"index": 1, "id": "call_b", "function": {"name": "f", "arguments": "{}"}}]),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": None},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
        ]
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [(o.call_id, o.arguments) for o in final.output[1:]] == [("call_a", '{"x": 1}'), ("call_b", "{}")]  # type: ignore[union-attr]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final.usage is not None and final.usage.total_tokens == 14


async def test_an_error_chunk_of_a_relayed_stream_ends_it_with_an_error_event() -> None:
    error = {"message": "engine crashed", "type": "server_error", "param": None, "code": "upstream_stream_cut"}
    events = await _run([_delta(content="Hel"), {"error": error}])
    assert events[-1] == {
        "type": "error",
        "sequence_number": len(events) - 1,
        "code": "upstream_stream_cut",
        "message": "engine crashed",
        "param": None,
    }
    assert "response.completed" not in [e["type"] for e in events]
