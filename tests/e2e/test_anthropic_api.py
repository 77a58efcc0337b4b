"""Anthropic's Messages and Message Batches APIs end to end (issue 11), driven by the official ``anthropic`` SDK in
strict response validation against a real server on the tiny model.

The database plays no part in the Messages tests; the Message Batches ones are the same durable batches as
``/v1/batches``, which other modules run on both databases. The module shares one SQLite server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import MessageParam

from tests.support.batches import jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, wait_for

MESSAGES = "/anthropic/v1/messages"
USER: list[MessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
#: ``temperature`` is no keyword of the SDK's ``messages.create`` any more; the API (and this server) still takes it.
GREEDY = {"temperature": 0.0}
#: a tool that takes no arguments: the call the grammar forces on the random tiny model is short
CLOSED = {"type": "object", "properties": {}, "additionalProperties": False}
#: a server tool (Anthropic runs it on its side): refused on its type
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search"}


@pytest.fixture(scope="module")
def server(sqlite_module_server: ServerProcess) -> ServerProcess:
    return sqlite_module_server


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    """The official ``anthropic`` SDK, strict, pointed at the server's ``/anthropic`` routes."""
    client = anthropic.Anthropic(
        base_url=server.base_url + "/anthropic", api_key="test", _strict_response_validation=True, max_retries=0
    )
    with client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    return server.http()


def body(content: str = "Tell me about the sea.", **extra: Any) -> dict[str, Any]:
    """A Messages body for the tiny model."""
    return {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": content}], **extra}


# -- Messages ------------------------------------------------------------------------------------------------------


def test_message_create(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="tiny", max_tokens=5, messages=USER)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert len(m.content) == 1 and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 5
    assert m.stop_sequence is None


def test_message_headers(http: httpx.Client) -> None:
    """x-api-key and anthropic-version are accepted; the provenance headers are the chat route's."""
    r = http.post(MESSAGES, json=body(), headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.headers["x-millm-model"] == "tiny" and r.headers["x-millm-backend"] == "serial"
    assert r.headers["x-millm-seed"].endswith('scope="server"') and r.headers["x-request-id"]


def test_message_equals_chat_at_temperature_0(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    """One inference path: a Messages request answers the same text as the equivalent chat request."""
    system = "You are terse."
    turns: list[MessageParam] = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Name a sea."},
    ]
    m = claude.messages.create(model="tiny", max_tokens=12, system=system, messages=turns, extra_body=GREEDY)
    chat_turns: list[Any] = [{"role": "system", "content": system}, *turns]
    c = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=chat_turns)
    assert m.content[0].type == "text"
    assert m.content[0].text == c.choices[0].message.content
    assert c.usage is not None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]


def test_stop_sequence(claude: anthropic.Anthropic) -> None:
    """A stop sequence taken from the greedy answer ends it there, named in ``stop_sequence``."""
    full = claude.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)
    text = full.content[0].text  # type: ignore[union-attr]
    stop = text[3:6]
    assert len(stop) == 3, text
    m = claude.messages.create(
        model="tiny", max_tokens=12, messages=USER, stop_sequences=["\x00never", stop], extra_body=GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_top_k_one_is_greedy(claude: anthropic.Anthropic) -> None:
    """``top_k`` is honoured: keeping one token is greedy decoding, whatever the temperature."""
    greedy = claude.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY)
    top1 = claude.messages.create(
        model="tiny", max_tokens=8, messages=USER, extra_body={"temperature": 1.0, "top_k": 1}
    )
    assert top1.content[0].text == greedy.content[0].text  # type: ignore[union-attr]


def test_message_stream(claude: anthropic.Anthropic) -> None:
    full = claude.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY)
    with claude.messages.stream(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == full.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_raw_event_sequence(http: httpx.Client) -> None:
    """The SSE frames name their event: message_start, content_block_start, deltas, stop, message_delta, stop."""
    with http.stream("POST", MESSAGES, json=body(stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    frames = [f for f in text.split("\n\n") if f.strip()]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert names == [d["type"] for d in datas]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) <= {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


# -- errors: Anthropic's envelope and status codes -------------------------------------------------------------------


def test_error_envelope(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="tiny", messages=USER, max_tokens=5, tools=[SERVER_TOOL])  # type: ignore[list-item]
    assert exc.value.status_code == 400
    assert exc.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid value for 'tools[0].type': 'web_search_20250305' is a server tool, which this server "
            "does not run; only client tools (a 'name', a 'description' and an 'input_schema', 'type' absent or "
            "'custom') are supported.",
        },
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nope", messages=USER, max_tokens=5)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    r = http.get("/anthropic/v1/nowhere")
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = http.post(MESSAGES, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "a " * 600_000}]})
    r = http.post(MESSAGES, content=big.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error", r.text[:300]
    assert (
        r.json()["error"]["type"] == "request_too_large"
        and "MISERVER_MAX_REQUEST_BYTES" in r.json()["error"]["message"]
    )
    assert "error" in http.get("/v1/nowhere").json() and "type" not in http.get("/v1/nowhere").json()


# -- batch lines on /v1/batches ----------------------------------------------------------------------------------------

#: Bodies each route refuses, by what is wrong with them.
REFUSED: dict[str, dict[str, Any]] = {
    "no_max_tokens": {"model": "tiny", "messages": USER},
    "server_tool": body(tools=[SERVER_TOOL]),
    "tool_schema": body(tools=[{"name": "t", "input_schema": {"type": "array"}}]),
    "tool_result": body()
    | {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none"}]}]},
    "thinking": body(thinking={"type": "enabled", "budget_tokens": 1024}),
    "image": body()
    | {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
    "unknown_block": body() | {"messages": [{"role": "user", "content": [{"type": "sound", "x": 1}]}]},
    "cache_control": body()
    | {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}}]}]},
    "prefill": body() | {"messages": [*USER, {"role": "assistant", "content": "The"}]},
    "temperature": body(temperature=1.5),
    "top_k": body(top_k=-1),
    "unknown_field": body(frobnicate=True),
    "system_role": body() | {"messages": [{"role": "system", "content": "x"}]},
    "model": body() | {"model": "nope"},
    "too_long": body(max_tokens=10**6),
}


def test_batch_lines_end_to_end(client: openai.OpenAI, http: httpx.Client) -> None:
    """A file of /anthropic/v1/messages lines through /v1/batches: each valid line's Message in ``response.body``
    (the synchronous answer at temperature 0), each refused line the synchronous route's status and Anthropic body
    (sent with ``X-miLLM-Strict``: batch lines are strict), with the same code and message under ``error``."""
    good = {f"ok-{i}": body(f"Row {i}.", temperature=0.0) for i in range(3)}
    good["ok-stop"] = body("Row stop.", temperature=0.0, stop_sequences=["e"], max_tokens=12)
    rows = {**good, **REFUSED}
    data = jsonl(line(cid, b, url=MESSAGES) for cid, b in rows.items())
    batch = wait_terminal(client, submit(client, data, endpoint=MESSAGES).id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(good), len(REFUSED))
    out = {x["custom_id"]: x for x in read_lines(client, batch.output_file_id)}
    errors = {x["custom_id"]: x for x in read_lines(client, batch.error_file_id)}
    assert set(out) == set(good) and set(errors) == set(REFUSED)
    for cid, b in good.items():
        sync = http.post(MESSAGES, json=b)
        assert sync.status_code == 200, sync.text
        got = out[cid]["response"]
        assert got["status_code"] == 200 and got["body"]["type"] == "message"
        assert got["body"]["content"] == sync.json()["content"] and got["body"]["usage"] == sync.json()["usage"]
        assert got["body"]["stop_reason"] == sync.json()["stop_reason"]
        assert got["millm"]["headers"]["X-miLLM-Model"] == "tiny"
    strict = {"x-millm-strict": "true"}
    for cid, b in REFUSED.items():
        sync = http.post(MESSAGES, json=b, headers=strict)
        answer = errors[cid]
        assert answer["response"]["status_code"] == sync.status_code, cid
        assert answer["response"]["body"] == sync.json(), cid
        assert sync.json()["type"] == "error" and sync.json()["error"]["message"] == answer["error"]["message"]
        assert sync.status_code in (400, 404), (cid, sync.text)


def test_refused_bodies_name_the_param(http: httpx.Client) -> None:
    """Each refusal is a 400 (404 for the model) whose message names the field."""
    named = {
        "no_max_tokens": "'max_tokens'",
        "server_tool": "'tools[0].type'",
        "tool_schema": "'tools[0].input_schema'",
        "tool_result": "'messages[0].content[0].tool_use_id'",
        "thinking": "'thinking'",
        "image": "'messages[0].content[0].type'",
        "unknown_block": "'messages[0].content[0].type'",
        "cache_control": "'messages[0].content[0].cache_control'",
        "prefill": "'messages[1].role'",
        "temperature": "'temperature'",
        "top_k": "'top_k'",
        "unknown_field": "frobnicate",
        "system_role": "'messages[0].role'",
        "model": "'nope'",
        "too_long": "maximum context length",
    }
    for cid, b in REFUSED.items():
        r = http.post(MESSAGES, json=b, headers={"x-millm-strict": "true"})
        assert named[cid] in r.json()["error"]["message"], (cid, r.text)
    lenient = http.post(MESSAGES, json=REFUSED["unknown_field"])
    assert lenient.status_code == 200, "without strict mode an unknown field is ignored"


# -- Message Batches -------------------------------------------------------------------------------------------------


def wait_ended(claude: anthropic.Anthropic, batch_id: str) -> Any:
    return wait_for(
        lambda: (b := claude.messages.batches.retrieve(batch_id)).processing_status == "ended" and b, timeout=120
    )


def test_message_batch_lifecycle(claude: anthropic.Anthropic, client: openai.OpenAI, http: httpx.Client) -> None:
    """create, retrieve, list, results, delete with the SDK; the same durable batch under /v1/batches."""
    requests: list[Any] = [{"custom_id": f"r-{i}", "params": body(f"Row {i}.", temperature=0.0)} for i in range(3)]
    requests.append({"custom_id": "bad", "params": body(tools=[SERVER_TOOL])})
    requests.append({"custom_id": "long", "params": body(max_tokens=10**6)})
    created = claude.messages.batches.create(requests=requests)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 5 and created.ended_at is None
    assert (created.expires_at - created.created_at).total_seconds() == 24 * 3600
    same = client.batches.retrieve("batch_" + created.id.removeprefix("msgbatch_"))
    assert same.endpoint == MESSAGES and same.completion_window == "24h"
    ended = wait_ended(claude, created.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 3, 2, 0, 0)
    assert ended.ended_at is not None and ended.results_url is not None
    results = {r.custom_id: r.result for r in claude.messages.batches.results(created.id)}
    assert set(results) == {"r-0", "r-1", "r-2", "bad", "long"}
    for i in range(3):
        ok = results[f"r-{i}"]
        assert ok.type == "succeeded"
        sync = claude.messages.create(**body(f"Row {i}."), extra_body=GREEDY)
        assert ok.message.content == sync.content and ok.message.usage == sync.usage
    bad = results["bad"]
    assert bad.type == "errored" and bad.error.error.type == "invalid_request_error"
    assert "'tools[0].type'" in bad.error.error.message
    assert results["long"].type == "errored" and "context length" in results["long"].error.error.message
    listed = [b.id for b in claude.messages.batches.list(limit=100)]
    assert created.id in listed
    deleted = claude.messages.batches.delete(created.id)
    assert deleted.id == created.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(created.id)
    assert http.get(f"/v1/batches/batch_{created.id.removeprefix('msgbatch_')}").status_code == 404


def test_message_batch_cancel(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    """While it runs a batch is neither deleted nor read (409); cancel: canceling, then ended with the unrun requests
    canceled."""
    requests: list[Any] = [{"custom_id": f"c-{i}", "params": body(f"Row {i}.", max_tokens=40)} for i in range(40)]
    created = claude.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.ConflictError) as exc:  # 40 rows of 40 tokens: still running a moment later
        claude.messages.batches.delete(created.id)
    assert exc.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    early = http.get(f"/anthropic/v1/messages/batches/{created.id}/results")
    assert early.status_code == 409 and early.json()["error"]["type"] == "invalid_request_error"
    canceled = claude.messages.batches.cancel(created.id)
    assert canceled.processing_status in ("canceling", "ended") and canceled.cancel_initiated_at is not None
    ended = wait_ended(claude, created.id)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.canceled + counts.errored == 40
    kinds = [r.result.type for r in claude.messages.batches.results(created.id)]
    assert len(kinds) == 40 and kinds.count("canceled") == counts.canceled
    claude.messages.batches.delete(created.id)


def test_message_batch_list_pages(claude: anthropic.Anthropic) -> None:
    """after_id / before_id pages, newest first, with has_more, first_id and last_id."""
    one: list[Any] = [{"custom_id": "x", "params": body()}]
    ids = [claude.messages.batches.create(requests=one).id for _ in range(3)]
    for batch_id in ids:
        wait_ended(claude, batch_id)
    first = claude.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert first.first_id == ids[2] and first.last_id == ids[1]
    second = claude.messages.batches.list(limit=2, after_id=ids[1])
    assert second.data[0].id == ids[0]
    back = claude.messages.batches.list(limit=1, before_id=ids[0])
    assert [b.id for b in back.data] == [ids[1]] and back.has_more
    for batch_id in ids:
        claude.messages.batches.delete(batch_id)


def test_message_batch_refusals(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    """Bad creates are 400s in Anthropic's envelope; unknown ids 404; results of a running batch 409."""
    for requests, named in (
        ([], "'requests'"),
        ([{"custom_id": "a b", "params": body()}], "'requests[0].custom_id'"),
        ([{"custom_id": "a", "params": body()}, {"custom_id": "a", "params": body()}], "'requests[1].custom_id'"),
        ([{"params": body()}], "'requests[0].custom_id'"),
    ):
        r = http.post("/anthropic/v1/messages/batches", json={"requests": requests})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert named in r.json()["error"]["message"], r.text
    for bad_id in ("msgbatch_nope", "batch_nope"):
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve(bad_id)
    r = http.get("/anthropic/v1/messages/batches", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_message_batch_may_be_larger_than_a_request(http: httpx.Client) -> None:
    """Its inline requests are a batch file's content: a body over ``MISERVER_MAX_REQUEST_BYTES`` (1 MiB) is taken
    (up to ``BATCH_MAX_FILE_BYTES``); each request stays within a batch line's size."""
    long_text = "a " * 200_000
    requests = [
        {
            "custom_id": f"r{i}",
            "params": {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": long_text}]},
        }
        for i in range(3)
    ]
    payload = json.dumps({"requests": requests}).encode()
    assert len(payload) > 1_048_576
    r = http.post("/anthropic/v1/messages/batches", content=payload, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["request_counts"]["processing"] == 3
    http.post(f"/anthropic/v1/messages/batches/{r.json()['id']}/cancel")


# -- token counting and models ------------------------------------------------------------------------------------


def test_count_tokens_equals_what_the_message_is_charged(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "Count the tokens of this prompt, please."}]
    counted = claude.messages.count_tokens(model="tiny", messages=messages, system="You are terse.")
    sent = claude.messages.create(model="tiny", max_tokens=2, messages=messages, system="You are terse.")
    assert counted.input_tokens == sent.usage.input_tokens > 0
    closed: Any = {"name": "f", "description": "Does f.", "input_schema": CLOSED}
    tools: Any = {"tools": [closed], "tool_choice": {"type": "any"}}
    with_tools = claude.messages.count_tokens(model="tiny", messages=messages, **tools)
    assert with_tools.input_tokens > counted.input_tokens, "the tool prompt is counted"
    called = claude.messages.create(model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY, **tools)
    assert called.usage.input_tokens == with_tools.input_tokens and called.stop_reason == "tool_use"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", messages=messages)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="tiny", messages=[])


def test_models_list_and_retrieve(claude: anthropic.Anthropic) -> None:
    listed = claude.models.list()
    assert [m.id for m in listed.data] == ["tiny"] and listed.data[0].type == "model"
    one = claude.models.retrieve("tiny")
    assert one.id == "tiny" and one.created_at is not None
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
