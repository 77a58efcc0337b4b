"""Checks of a chat body that need no model (``chat.parse``, ``tools.parse_tools``, the response format's
``constraints.grammar_of``): a mistake in a tool turn, a forced tool choice or a response format is a 400 naming
the field, never accepted and ignored, in lenient and strict mode alike."""

from __future__ import annotations

from typing import Any

import pytest

from miserver.errors import APIError
from miserver.services.inference import chat
from miserver.services.inference.constraints import grammar_of
from miserver.services.inference.tools import parse_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "max_tokens": 2, **extra}


def refusal(value: dict[str, Any], strict: bool) -> APIError:
    with pytest.raises(APIError) as caught:
        chat.parse(value, strict=strict)
    return caught.value


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_zzz", "content": "18C"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "sure"},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        ],
        [{"role": "user", "content": "hi"}, ASKED, {"role": "tool", "tool_call_id": "call_2", "content": "18C"}],
    ],
)
def test_a_tool_turn_must_answer_an_earlier_call(messages: list[dict[str, Any]], strict: bool) -> None:
    error = refusal(body(messages, tools=[TOOL]), strict)
    assert (error.status_code, error.code, error.param) == (
        400,
        "invalid_value",
        f"messages[{len(messages) - 1}].tool_call_id",
    )


def test_a_tool_turn_answering_its_call_passes() -> None:
    turns = [{"role": "user", "content": "hi"}, ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    assert chat.parse(body(turns, tools=[TOOL]), strict=True).messages[2].tool_call_id == "call_1"


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "function", "name": "get_weather"}])
def test_a_forced_tool_choice_names_its_function(choice: dict[str, Any]) -> None:
    with pytest.raises(APIError) as caught:
        parse_tools([TOOL], choice)
    error = caught.value
    assert (error.code, error.param) == ("missing_required_parameter", "tool_choice.function.name")
    assert "None" not in error.message
    assert ("under 'function'" in error.message) is ("name" in choice)


@pytest.mark.parametrize(
    ("form", "code", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": SCHEMA}},
            "invalid_type",
            "strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "strict": 1, "schema": SCHEMA}},
            "invalid_type",
            "strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "description": 3, "schema": SCHEMA}},
            "invalid_type",
            "description",
        ),
        ({"type": "json_schema", "json_schema": {"name": "has space!", "schema": SCHEMA}}, "invalid_value", "name"),
        ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}, "invalid_value", "name"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "schemaa": {}}},
            "unknown_parameter",
            "schemaa",
        ),
    ],
)
def test_a_json_schema_format_is_checked_field_by_field(form: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(APIError) as caught:
        grammar_of(form, param="response_format")
    assert (caught.value.code, caught.value.param) == (code, f"response_format.json_schema.{param}")
    flat = {"type": "json_schema", **form["json_schema"]}
    with pytest.raises(APIError) as flat_caught:
        grammar_of(flat, param="text.format", flat=True)
    assert (flat_caught.value.code, flat_caught.value.param) == (code, f"text.format.{param}")


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_a_schema_beside_another_format_type_is_refused(kind: str) -> None:
    with pytest.raises(APIError) as caught:
        grammar_of({"type": kind, "json_schema": {"name": "x", "schema": SCHEMA}}, param="response_format")
    assert (caught.value.code, caught.value.param) == ("unknown_parameter", "response_format.json_schema")
    assert f"with type '{kind}'" in caught.value.message


def test_a_well_formed_schema_format_compiles_to_its_grammar() -> None:
    form = {
        "type": "json_schema",
        "json_schema": {"name": "x-1", "description": "d", "strict": False, "schema": SCHEMA},
    }
    grammar = grammar_of(form, param="response_format")
    assert grammar is not None and grammar.kind == "json_schema"
