"""The Responses API end to end (issue 11): ``POST /v1/responses`` (JSON and streamed), stored Responses
(``GET``/``DELETE``, ``previous_response_id``), Responses batch lines, and refusals, with the official SDK in strict
response validation against a real server on the tiny model (SQLite, then PostgreSQL: stored Responses live there).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tests.support.batches import api_error, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess

URL = "/v1/responses"
#: OpenAI's floor for ``max_output_tokens``.
MAX = 16


@pytest.fixture(scope="module")
def client(module_server: ServerProcess) -> openai.OpenAI:
    return module_server.client()


def chat_text(client: openai.OpenAI, messages: list[Any], max_tokens: int = MAX) -> str:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


# -- POST /v1/responses ------------------------------------------------------------------------------------------


def test_create_returns_a_response_object(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model="tiny", input="Tell me about the sea.", max_output_tokens=MAX)
    assert raw.headers["x-millm-model"] == "tiny" and raw.headers["x-millm-seed"].endswith('scope="server"')
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    assert len(r.output) == 1
    item = r.output[0]
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [c.type for c in item.content] == ["output_text"]
    assert r.output_text == item.content[0].text  # type: ignore[union-attr]
    assert r.usage is not None
    assert r.usage.input_tokens > 0 and 1 <= r.usage.output_tokens <= MAX
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    if r.usage.output_tokens == MAX:
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens" and item.status == "incomplete"
    else:
        assert r.status == "completed" and r.completed_at is not None
    assert r.model_dump()["store"] is True and r.max_output_tokens == MAX and r.tools == [] and r.text is not None


def test_same_text_as_the_equivalent_chat_request(client: openai.OpenAI) -> None:
    turns: list[Any] = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
        {"role": "developer", "content": "Answer in English."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a colour."}],
        },
    ]
    r = client.responses.create(
        model="tiny",
        instructions="You are terse.",
        input=turns,
        max_output_tokens=MAX,
        temperature=0,
        metadata={"k": "v"},
        user="u-1",
    )
    expected = chat_text(
        client,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there."},
            {"role": "system", "content": "Answer in English."},
            {"role": "user", "content": "Name a colour."},
        ],
    )
    assert r.output_text == expected
    assert r.metadata == {"k": "v"} and r.user == "u-1" and r.instructions == "You are terse." and r.temperature == 0


def test_text_format_text_and_neutral_values_are_accepted(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="tiny",
        input="x",
        max_output_tokens=MAX,
        text={"format": {"type": "text"}},
        tools=[],
        tool_choice="auto",
        background=False,
        truncation="disabled",
        service_tier="auto",
        store=False,
    )
    assert r.object == "response" and r.model_dump()["store"] is False


# -- stored Responses --------------------------------------------------------------------------------------------


def test_store_retrieve_and_delete(client: openai.OpenAI, module_server: ServerProcess) -> None:
    r = client.responses.create(model="tiny", input="Keep me.", max_output_tokens=MAX)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    gone = api_error(client.responses.retrieve, r.id)
    assert gone.status_code == 404 and error_of(gone)["message"] == f"Response with id '{r.id}' not found."
    assert api_error(client.responses.delete, r.id).status_code == 404
    deleted = module_server.http().delete(f"/v1/responses/{got.id}")
    assert deleted.status_code == 404
    kept = client.responses.create(model="tiny", input="Delete me.", max_output_tokens=MAX)
    answer = module_server.http().delete(f"/v1/responses/{kept.id}")
    assert answer.status_code == 200 and answer.json() == {"id": kept.id, "object": "response", "deleted": True}

    unstored = client.responses.create(model="tiny", input="Forget me.", max_output_tokens=MAX, store=False)
    assert unstored.model_dump()["store"] is False
    assert api_error(client.responses.retrieve, unstored.id).status_code == 404


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", instructions="Be kind.", input="Hello", max_output_tokens=MAX, temperature=0
    )
    second = client.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=MAX, temperature=0
    )
    assert second.previous_response_id == first.id
    # the previous input and output are earlier turns; its instructions are not carried over (as OpenAI's)
    expected = chat_text(
        client,
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.output_text == expected
    third = client.responses.create(
        model="tiny", input="Last.", previous_response_id=second.id, max_output_tokens=MAX, temperature=0
    )
    assert third.usage is not None and second.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    missing = api_error(client.responses.create, model="tiny", input="x", previous_response_id="resp_nope")
    assert missing.status_code == 400
    assert error_of(missing)["code"] == "previous_response_not_found"
    assert error_of(missing)["param"] == "previous_response_id"


# -- streaming ---------------------------------------------------------------------------------------------------


def test_stream_with_the_sdk_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="Stream it.", max_output_tokens=MAX, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = kinds.index("response.output_text.done")
    assert set(kinds[4:end]) == {"response.output_text.delta"}
    assert kinds[end:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert final.output_text == deltas and final.id == events[0].response.id  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
    # the same text as the non-streamed request, and the streamed Response is stored
    plain = client.responses.create(model="tiny", input="Stream it.", max_output_tokens=MAX, temperature=0)
    assert plain.output_text == deltas
    assert client.responses.retrieve(final.id).output_text == deltas
    if last.type == "response.completed":
        assert stream.get_final_response().output_text == deltas


def test_stream_events_on_the_wire(module_server: ServerProcess) -> None:
    body = {"model": "tiny", "input": "Wire.", "max_output_tokens": MAX, "stream": True, "store": False}
    with module_server.http().stream("POST", URL, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-millm-model"] == "tiny"
        text = r.read().decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    assert "[DONE]" not in text


# -- refusals: the synchronous route and a batch line answer alike -------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("web-search", {"tools": [{"type": "web_search"}]}, 400, "unsupported_value", "tools[0].type"),
    ("mcp", {"tools": [{"type": "mcp", "server_label": "x"}]}, 400, "unsupported_value", "tools[0].type"),
    ("tool-name", {"tools": [{"type": "function", "name": "a b"}]}, 400, "invalid_value", "tools[0].name"),
    ("tool-choice", {"tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ("reasoning", {"reasoning": {"effort": "high"}}, 400, "unsupported_parameter", "reasoning"),
    ("background", {"background": True}, 400, "unsupported_parameter", "background"),
    ("include", {"include": ["message.output_text.logprobs"]}, 400, "unsupported_parameter", "include"),
    ("stop", {"stop": ["\n"]}, 400, "unsupported_parameter", "stop"),
    ("top-logprobs", {"top_logprobs": 2}, 400, "unsupported_parameter", "top_logprobs"),
    (
        "strict-schema",
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
                    "strict": True,
                }
            }
        },
        400,
        "invalid_value",
        "text.format.schema",
    ),
    (
        "no-schema",
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        400,
        "missing_required_parameter",
        "text.format.schema",
    ),
    ("format-type", {"text": {"format": {"type": "yaml"}}}, 400, "invalid_value", "text.format.type"),
    (
        "image",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        400,
        "unsupported_value",
        "input[0].content[0].type",
    ),
    (
        "file",
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
        400,
        "unsupported_value",
        "input[0].content[0].type",
    ),
    (
        "reasoning-item",
        {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
        400,
        "unsupported_value",
        "input[0].type",
    ),
    (
        "uncalled-output",
        {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]},
        400,
        "invalid_value",
        "input[0].call_id",
    ),
    ("bad-role", {"input": [{"role": "tool", "content": "x"}]}, 400, "invalid_value", "input[0].role"),
    ("few-tokens", {"max_output_tokens": 5}, 400, "invalid_value", "max_output_tokens"),
    ("unknown-field", {"frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ("no-input", {"input": None}, 400, "missing_required_parameter", "input"),
    ("no-model", {"model": "no-such-model"}, 404, "model_not_found", "model"),
]


def _refused_body(change: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "input": "Hi", "max_output_tokens": MAX, **change}
    return {k: v for k, v in body.items() if v is not None}


def test_each_refusal_is_the_same_on_the_route_and_in_a_batch(
    client: openai.OpenAI, module_server: ServerProcess
) -> None:
    http = module_server.http()
    sync: dict[str, tuple[int, dict[str, Any]]] = {}
    for name, change, status, code, param in REFUSED:
        r = http.post(URL, json=_refused_body(change), headers={"X-miLLM-Strict": "true"})
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (status, code, param), (name, error)
        sync[name] = (r.status_code, error)
    lines = [line(name, _refused_body(change), url=URL) for name, change, *_ in REFUSED]
    lines.append(line("ok", _refused_body({}), url=URL))
    done = wait_terminal(client, submit(client, jsonl(lines), endpoint=URL).id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, len(REFUSED))
    for x in read_lines(client, done.error_file_id):
        status, error = sync[x["custom_id"]]
        assert x["response"]["status_code"] == status, x
        # refused at validation (the line number is given): the param is named inside the line (body.<field>)
        at_validation = "line" in (x.get("millm") or {})
        param = f"body.{error['param']}" if at_validation and error["param"] else error["param"]
        assert x["response"]["body"]["error"] == {**error, "param": param}, x
        assert x["error"] == {"code": error["code"], "message": error["message"]}


def test_lenient_mode_ignores_unknown_fields_but_never_unsupported_ones(module_server: ServerProcess) -> None:
    http = module_server.http()
    assert http.post(URL, json=_refused_body({"frobnicate": 1, "store": False})).status_code == 200
    tools = http.post(URL, json=_refused_body({"tools": [{"type": "web_search"}]}))
    assert tools.status_code == 400 and tools.json()["error"]["code"] == "unsupported_value"


def test_unknown_response_is_404(client: openai.OpenAI, module_server: ServerProcess) -> None:
    assert api_error(client.responses.retrieve, "resp_unknown").status_code == 404
    assert api_error(client.responses.delete, "resp_unknown").status_code == 404
    replay = module_server.http().get("/v1/responses/resp_unknown", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


# -- batch lines -------------------------------------------------------------------------------------------------


def test_a_batch_of_responses_lines_end_to_end(client: openai.OpenAI) -> None:
    prompts = ["One.", "Two.", "Three."]
    bodies = [
        {"model": "tiny", "input": p, "max_output_tokens": MAX, "temperature": 0, "store": False} for p in prompts
    ]
    bodies.append(
        {
            "model": "tiny",
            "input": [{"role": "user", "content": "Four."}],
            "max_output_tokens": MAX,
            "temperature": 0,
            "instructions": "Short.",
        }
    )
    done = wait_terminal(
        client, submit(client, jsonl(line(f"r-{i}", b, url=URL) for i, b in enumerate(bodies)), endpoint=URL).id
    )
    assert done.status == "completed" and done.endpoint == URL and done.error_file_id is None
    assert done.request_counts is not None and done.request_counts.completed == len(bodies)
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r-{i}" for i in range(len(bodies))]
    total_in = total_out = 0
    for x, body in zip(out, bodies):
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert x["response"]["millm"]["headers"]["X-miLLM-Model"] == "tiny"
        response = Response.model_validate(x["response"]["body"])
        assert response.id.startswith("resp_") and response.object == "response"
        sync = client.responses.create(**{**body, "store": False})  # type: ignore[call-overload]
        assert response.output_text == sync.output_text, "a batch row is the synchronous request"
        assert response.usage is not None
        total_in += response.usage.input_tokens
        total_out += response.usage.output_tokens
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (total_in, total_out)
    stored = Response.model_validate(out[3]["response"]["body"])
    assert client.responses.retrieve(stored.id).output_text == stored.output_text, "store defaults to true"


# -- what clients and peer suites ask for -------------------------------------------------------------------------


def test_the_response_echoes_penalties_safety_identifier_and_prompt_cache_key(module_server: ServerProcess) -> None:
    http = module_server.http()
    base = {"model": "tiny", "input": "Hi", "max_output_tokens": MAX}
    plain = http.post(URL, json=base).json()
    assert (plain["presence_penalty"], plain["frequency_penalty"]) == (0.0, 0.0)
    assert plain["safety_identifier"] is None and plain["prompt_cache_key"] is None
    sent = {
        **base,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "safety_identifier": "u-7",
        "prompt_cache_key": "k",
    }
    echoed = http.post(URL, json=sent, headers={"X-miLLM-Strict": "true"}).json()
    assert (echoed["safety_identifier"], echoed["prompt_cache_key"]) == ("u-7", "k")
    assert (echoed["presence_penalty"], echoed["frequency_penalty"]) == (0.0, 0.0)
    honoured = http.post(URL, json={**base, "presence_penalty": 0.5, "frequency_penalty": -0.5})
    assert honoured.status_code == 200, honoured.text
    assert (honoured.json()["presence_penalty"], honoured.json()["frequency_penalty"]) == (0.5, -0.5)


def test_input_items_list_the_conversation_that_went_in(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", input="Name a colour.", max_output_tokens=MAX, instructions="Be brief."
    )
    second = client.responses.create(
        model="tiny", input="And another one.", previous_response_id=first.id, max_output_tokens=MAX
    )
    items = client.responses.input_items.list(second.id, order="asc")
    roles = [(item.type, getattr(item, "role", None)) for item in items.data]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user")]
    texts = [part.text for item in items.data for part in item.content]  # type: ignore[union-attr]
    assert texts[0] == "Name a colour." and texts[2] == "And another one."
    assert texts[1] == first.output_text  # the earlier answer, as it was returned, under its own message id
    assert items.data[1].id == first.output[0].id
    assert items.data[1].content[0].type == "output_text"  # type: ignore[union-attr]
    newest_first = client.responses.input_items.list(second.id)
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(items.data)]
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert page.has_more and [i.id for i in page.data] == [items.data[0].id]
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[1:]] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(first.id).data] == [items.data[0].id]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list(second.id, limit=101)
    assert bad.value.body["param"] == "limit"  # type: ignore[index]
