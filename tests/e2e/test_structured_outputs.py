"""Structured outputs, ``logit_bias`` and penalties on the real embedded model (SmolLM2-135M-Instruct), with the
official SDK in strict mode.

The SDK's own helpers (``chat.completions.parse`` and ``responses.parse`` with a pydantic model) work unchanged; a
Batch API file of 100 extraction lines with one ``json_schema`` runs packed and unpacked, and every output
parses and validates against its schema; each answer says it was constrained (``X-miLLM-Grammar``, copied
into a batch line's ``millm.headers``); a schema refused by strict mode or by the compiler fails its line alone,
with the field named; output cut by ``max_tokens`` ends ``length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ValidationError

from miserver.engines.local.loader import load_tokenizer, resolve_model_source
from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.batches import api_error, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, real_model_server
from tests.support.tiny_model import default_cache_dir

pytestmark = pytest.mark.slow

MODEL = EMBEDDED_MODEL_ID
NAMES = ["John Smith", "Mary Jones", "Ali Khan", "Li Wei", "Ana Silva", "Tom Brown", "Eva Novak", "Raj Patel"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Quito", "Dublin", "Seoul"]


class Person(BaseModel):
    name: str
    age: int
    city: str


SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def extraction(i: int) -> str:
    return f"Extract the person as JSON: {NAMES[i % 8]} is {20 + i % 50} years old and lives in {CITIES[i % 10]}."


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": extraction(i)}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": FORMAT,
        **extra,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("structured")
    proc = real_model_server(tmp)
    with proc:
        yield proc


def test_the_sdks_parse_helpers_get_a_validated_object(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    raw = client.chat.completions.with_raw_response.parse(
        model=MODEL,
        messages=[{"role": "user", "content": extraction(0)}],
        response_format=Person,
        max_tokens=40,
        temperature=0,
    )
    assert raw.headers["X-miLLM-Grammar"] == "xgrammar"
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    response = client.responses.parse(
        model=MODEL, input=extraction(1), text_format=Person, max_output_tokens=40, temperature=0
    )
    assert isinstance(response.output_parsed, Person)
    assert response.text.format.type == "json_schema"  # the format is echoed


def test_json_object_and_a_cut_object(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=3, temperature=0
    )
    assert done.choices[0].finish_reason == "length", "3 tokens cannot close an object: never presented as complete"
    assert done.choices[0].message.content and done.choices[0].message.content.startswith("{")
    stream = client.chat.completions.create(**body(2, max_tokens=6), stream=True)
    reasons = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]


def test_bad_schemas_and_biases_are_refused_naming_the_field(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    lax = {"type": "object", "properties": {"a": {"type": "string"}}}
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": lax, "strict": True}}, "additionalProperties"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "objekt"),
    ]
    for fmt, reason in cases:
        exc = api_error(client.chat.completions.create, **{**body(0), "response_format": fmt})
        assert exc.status_code == 400
        assert error_of(exc)["param"] == "response_format.json_schema.schema" and reason in error_of(exc)["message"]
    exc = api_error(client.chat.completions.create, **{**body(0), "logit_bias": {"49152": 5}})
    assert (exc.status_code, error_of(exc)["param"]) == (400, "logit_bias")
    exc = api_error(
        client.responses.create,
        model=MODEL,
        input="x",
        text={"format": {"type": "json_schema", "name": "x", "schema": lax, "strict": True}},
    )
    assert (exc.status_code, error_of(exc)["param"]) == (400, "text.format.schema")


def first_token(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[ChatCompletion, str, int]:
    """The greedy 12-token answer to ``messages``, its first token's text and that token's id (from the model's own
    tokenizer)."""
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs and plain.choices[0].logprobs.content
    first = plain.choices[0].logprobs.content[0].token
    tokenizer = load_tokenizer(resolve_model_source(MODEL), default_cache_dir())
    (token_id,) = tokenizer.convert_tokens_to_ids([tokenizer.tokenize(first)[0]])
    return plain, first, int(token_id)


def test_logit_bias_and_penalties_change_the_answer(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    messages = [{"role": "user", "content": "Name three fruits."}]
    plain, _, token_id = first_token(client, messages)  # ban it and the answer must start otherwise
    banned = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logit_bias={str(token_id): -100}
    )
    assert banned.choices[0].message.content != plain.choices[0].message.content
    penalised = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    ask = {"model": MODEL, "input": "Name three fruits.", "max_output_tokens": 16, "temperature": 0}
    unpenalised = client.responses.create(**ask)
    response = client.responses.create(**ask, extra_body={"presence_penalty": 1.5, "frequency_penalty": 2.0})
    assert (response.presence_penalty, response.frequency_penalty) == (1.5, 2.0)  # echoed, and honoured
    assert response.output_text != unpenalised.output_text


@pytest.mark.parametrize("pack", [True, False])
def test_an_extraction_batch_validates_every_row(server: ServerProcess, pack: bool) -> None:
    client = server.client(timeout=60.0)
    rows = 50
    lines = [line(f"p-{i:03d}", body(i)) for i in range(rows)]
    lines.append(line("bad", {**body(0), "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}))
    batch = submit(client, jsonl(lines), extra_body={"pack": pack})
    done = wait_terminal(client, batch.id, timeout=900)
    assert done.status == "completed", done
    out = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"p-{i:03d}" for i in range(rows)]
    invalid = []
    for o in out:
        response = o["response"]
        assert response["status_code"] == 200
        assert response["millm"]["headers"]["X-miLLM-Grammar"] == "xgrammar"
        choice = response["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        try:
            Person.model_validate_json(choice["message"]["content"])
        except ValidationError as exc:
            invalid.append((o["custom_id"], str(exc)))
    assert not invalid
    (err,) = read_lines(client, done.error_file_id)
    assert err["custom_id"] == "bad"
    assert err["response"]["body"]["error"]["param"] == "body.response_format.json_schema.schema"


# -- tools: the generic tool prompt, calls forced by grammar, results fed back ------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_call_round_trip(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        first = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=40,
            temperature=0,  # type: ignore[arg-type]
        )
        done = first.choices[0]
        assert done.finish_reason == "tool_calls" and done.message.content is None
        assert done.message.tool_calls and len(done.message.tool_calls) == 1
        call = done.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
        assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, result]
    final = client.chat.completions.create(
        model=MODEL,
        messages=turns,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_streamed_tool_call_deltas(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    calls, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    assert [c.function.name for c in calls if c.function] == ["get_weather"]
    assert calls[0].id and calls[0].id.startswith("call_")


def test_tool_errors_name_the_field(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    bad_name = {"type": "function", "function": {"name": "no spaces allowed"}}
    for kwargs, param in (
        ({"tools": [bad_name]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ):
        exc = api_error(client.chat.completions.create, model=MODEL, messages=ASK, max_tokens=4, **kwargs)
        assert (exc.status_code, error_of(exc)["param"]) == (400, param)
    exc = api_error(
        client.chat.completions.create, model=MODEL, messages=[*ASK, {"role": "tool", "content": "x"}], max_tokens=4
    )
    assert (exc.status_code, error_of(exc)["param"]) == (400, "messages[1].tool_call_id")


def test_a_batch_with_tools(server: ServerProcess) -> None:
    client = server.client(timeout=60.0)
    cities = ["Paris", "Rome", "Oslo", "Lima"]
    lines = [
        line(
            f"t-{i}",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
                "tools": [WEATHER],
                "tool_choice": "required",
                "max_tokens": 40,
                "temperature": 0,
            },
        )
        for i, city in enumerate(cities)
    ]
    done = wait_terminal(client, submit(client, jsonl(lines), extra_body={"pack": True}).id, timeout=600)
    assert done.status == "completed", done
    for o in read_lines(client, done.output_file_id):
        choice = o["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("pack", [True, False])
def test_one_openai_batch_file_with_every_field_runs_unchanged(server: ServerProcess, pack: bool) -> None:
    """A file as an OpenAI Batch job would take it: json_schema, tools, logit_bias and penalties side by side."""
    client = server.client(timeout=60.0)
    fruits = [{"role": "user", "content": "Name three fruits."}]
    plain, first, token_id = first_token(client, fruits)
    ask = {"model": MODEL, "messages": fruits, "max_tokens": 12, "temperature": 0, "logprobs": True}
    weather = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40}
    lines = [
        line("schema", body(3)),
        line("tools", {**weather, "temperature": 0}),
        line("plain", ask),
        line("banned", {**ask, "logit_bias": {str(token_id): -100}}),
        line("penalised", {**ask, "frequency_penalty": 2.0, "presence_penalty": 2.0}),
    ]
    done = wait_terminal(client, submit(client, jsonl(lines), extra_body={"pack": pack}).id, timeout=600)
    assert done.status == "completed" and done.request_counts and done.request_counts.failed == 0, done
    out = {o["custom_id"]: o["response"] for o in read_lines(client, done.output_file_id)}
    assert sorted(out) == sorted(x["custom_id"] for x in lines)
    assert all(r["status_code"] == 200 for r in out.values())
    schema = out["schema"]["body"]["choices"][0]
    assert schema["finish_reason"] == "stop" and Person.model_validate_json(schema["message"]["content"])
    assert out["schema"]["millm"]["headers"]["X-miLLM-Grammar"] == "xgrammar"
    tools = out["tools"]["body"]["choices"][0]
    assert tools["finish_reason"] == "tool_calls"
    (call,) = tools["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    texts = {k: out[k]["body"]["choices"][0]["message"]["content"] for k in ("plain", "banned", "penalised")}
    tokens = {k: [t["token"] for t in out[k]["body"]["choices"][0]["logprobs"]["content"]] for k in texts}
    assert tokens["plain"][0] == first, "the row without processors answers as the route does"
    assert tokens["banned"][0] != first, "logit_bias -100 on the first token: the row starts otherwise"
    assert texts["penalised"] != texts["plain"], "penalties of 2.0 change a greedy 12-token answer"
