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
    req = request(max_output_tokens=32, temperature=0.5, top_p=0.9, user="u", metadata={"a": "b"})
    assert responses._chat_body(req, responses.input_turns(req, [])) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
    }


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
    error = responses._from_chat(ContextLengthError("too long", param="messages"))
    assert isinstance(error, ContextLengthError) and error.param == "input" and error.code == "context_length_exceeded"
    other = ModelNotFoundError("x", param="model")
    assert responses._from_chat(other) is other


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
