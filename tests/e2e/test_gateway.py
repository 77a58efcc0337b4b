"""Gateway mode (issue 12) against real upstream processes: two ``miserver serve`` on the tiny model (served as
``tiny-up``, one pool) and small real HTTP servers that misbehave on purpose (:mod:`tests.support.fake_upstream`),
behind one gateway that also has the tiny model resident (as ``tiny``). The official SDK drives the gateway.

The module shares its processes; the last test kills upstream ``a``.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import tiny_server_process, wait_for

UP = "tiny-up"
#: Seconds a server may take to start (three start at once here, on a machine that may be busy).
START_TIMEOUT = 600
FAKES: dict[str, dict[str, Any]] = {
    "flaky": {"fail_first": 2, "envelope": "sglang"},
    "slow": {"delay": 30},
    "cut": {"cut_stream": True},
    "errchunk": {"error_chunk": True},
    "gone": {"delay": 0.3},
}
#: a tool that takes no arguments: the call the grammar forces on the random tiny model is short
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``{"a", "b": upstream miServers, fake name: FakeUpstream, "gateway": ServerProcess, "root": Path}``."""
    root = tmp_path_factory.mktemp("gateway")
    ups = {n: tiny_server_process(tiny_model_dir, root / n, served_model_name=UP) for n in ("a", "b")}
    fakes = {n: FakeUpstream(model=n, log=root / f"{n}.requests", **opts) for n, opts in FAKES.items()}
    started: list[Any] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            started += list(pool.map(lambda s: s.start(timeout=START_TIMEOUT), ups.values()))
        started += [f.start() for f in fakes.values()]
        entries = [f"{n}={s.base_url};max_in_flight=2" for n, s in ups.items()]
        options = {"slow": ";total_timeout=1", "gone": ";max_in_flight=1"}  # gone: one row at a time, 0.3 s each
        entries += [f"{n}={f.base_url}" + options.get(n, "") for n, f in fakes.items()]
        gateway = tiny_server_process(
            tiny_model_dir,
            root / "gateway",
            env={
                "MISERVER_UPSTREAMS": ",".join(entries),
                "MISERVER_UPSTREAM_BACKOFF_SECONDS": "0.05",
                "MISERVER_UPSTREAM_HEALTH_SECONDS": "0.5",
                "BATCH_POLL_SECONDS": "0.2",
            },
        )
        started.append(gateway.start(timeout=START_TIMEOUT))
        yield {**ups, **fakes, "gateway": gateway, "root": root}
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def client(fleet: dict[str, Any]) -> openai.OpenAI:
    return fleet["gateway"].client()  # type: ignore[no-any-return]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The two bodies agree but for the per-response id and time."""
    assert {k: v for k, v in a.items() if k not in ("id", "created")} == {
        k: v for k, v in b.items() if k not in ("id", "created")
    }


def test_discovery_lists_every_model_once(client: openai.OpenAI) -> None:
    models = {m.id: m.owned_by for m in client.models.list().data}
    assert models == {
        "tiny": "miserver",
        UP: "upstream:a,b",
        **{n: f"upstream:{n}" for n in FAKES},
    }
    assert client.models.retrieve(UP).owned_by == "upstream:a,b"


def test_sync_requests_equal_the_upstreams_direct_answer(fleet: dict[str, Any]) -> None:
    gateway, direct = fleet["gateway"].http(), fleet["a"].http()
    cases = [
        ("/v1/chat/completions", chat_body("Name a colour.", model=UP, max_tokens=6, temperature=0, seed=3)),
        ("/v1/completions", {"model": UP, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}),
        ("/v1/embeddings", {"model": UP, "input": ["hello", "world"]}),
    ]
    for path, body in cases:
        via, straight = gateway.post(path, json=body), direct.post(path, json=body)
        assert via.status_code == straight.status_code == 200, via.text
        _same(via.json(), straight.json())
        assert via.json()["model"] == UP
        assert via.headers["x-millm-backend"] in ("upstream:a", "upstream:b")
        assert via.headers["x-millm-model"] == UP
        assert via.headers["x-millm-weights"] == straight.headers["x-millm-weights"]
    refused = gateway.post("/v1/chat/completions", json={**cases[0][1], "temperature": 9})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"


def test_constraining_fields_are_relayed_as_sent(fleet: dict[str, Any], client: openai.OpenAI) -> None:
    """``response_format``, ``logit_bias`` and penalties reach the upstream, which honours them (its answer, its
    grammar header); ``tools`` too, to an upstream that takes them (the fake) or honours them (a miServer)."""
    gateway, direct = fleet["gateway"].http(), fleet["a"].http()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = chat_body(
        "Answer as JSON.",
        model=UP,
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}},
        logit_bias={"28": -100},
        frequency_penalty=1.0,
        presence_penalty=0.5,
    )
    via, straight = gateway.post("/v1/chat/completions", json=body), direct.post("/v1/chat/completions", json=body)
    assert via.status_code == straight.status_code == 200, via.text
    _same(via.json(), straight.json())
    assert via.headers["x-millm-grammar"] == straight.headers["x-millm-grammar"] == "xgrammar"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    relayed = client.chat.completions.create(**chat_body("hi", model="gone"), tools=[tool])  # type: ignore[arg-type]
    assert relayed.choices[0].message.content == "echo: hi"  # the fake takes the field: the gateway kept out of it
    # arguments closed to ``{}``: the forced call's length cannot depend on what the random model picks
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    closed = {"type": "function", "function": {"name": "f", "parameters": no_arguments}}
    called = gateway.post(
        "/v1/chat/completions",
        json={**chat_body("hi", model=UP, max_tokens=24, temperature=0), "tools": [closed], "tool_choice": "required"},
    )
    assert called.status_code == 200, called.text  # the upstream miServer made the call the grammar forced
    choice = called.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_stream_is_relayed_with_the_model_kept(client: openai.OpenAI) -> None:
    body = chat_body("Count to three.", model=UP, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**body)
    parts = list(client.chat.completions.create(**body, stream=True))
    assert {p.model for p in parts} == {UP}
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == whole.choices[0].message.content


@pytest.mark.parametrize("model, message", [("cut", "closed the stream"), ("errchunk", "engine crashed")])
def test_a_cut_stream_or_an_error_chunk_is_an_error(client: openai.OpenAI, model: str, message: str) -> None:
    with pytest.raises(openai.APIError, match=message):
        for _ in client.chat.completions.create(**chat_body("hi", model=model), stream=True):
            pass


def test_anthropic_messages_are_relayed_as_chat_requests(fleet: dict[str, Any]) -> None:
    """A Messages request naming an upstream model goes to it as the equivalent chat request: the Message carries
    the upstream's answer (what it gives that chat request directly), streamed too; a forced call of a tool is a
    ``tool_use`` block (the upstream miServer makes it)."""
    gateway, direct = fleet["gateway"], fleet["a"].http()
    claude = anthropic.Anthropic(
        base_url=gateway.base_url + "/anthropic", api_key="k", _strict_response_validation=True
    )
    turns: Any = [{"role": "user", "content": "Name a colour."}]
    m = claude.messages.with_raw_response.create(
        model=UP, max_tokens=6, system="Be brief.", messages=turns, extra_body={"temperature": 0}
    )
    assert m.headers["x-millm-backend"] in ("upstream:a", "upstream:b") and m.headers["x-millm-model"] == UP
    message = m.parse()
    body = {"model": UP, "max_tokens": 6, "temperature": 0, "messages": [{"role": "system", "content": "Be brief."}]}
    straight = direct.post("/v1/chat/completions", json={**body, "messages": body["messages"] + turns}).json()
    assert message.model == UP and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == straight["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        straight["usage"]["prompt_tokens"],
        straight["usage"]["completion_tokens"],
    )
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[straight["choices"][0]["finish_reason"]]
    with claude.messages.stream(
        model=UP, max_tokens=6, system="Be brief.", messages=turns, extra_body={"temperature": 0}
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in streamed.content] == [("text", message.content[0].text)]  # type: ignore[union-attr]
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )
    closed: Any = {"name": "f", "description": "Does f.", "input_schema": NO_ARGUMENTS}
    called = claude.messages.create(
        model=UP,
        max_tokens=24,
        messages=turns,
        tools=[closed],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert called.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in called.content] == [("tool_use", "f", {})]  # type: ignore[union-attr]
    assert called.content[0].id.startswith("toolu_")  # type: ignore[union-attr]
    counted = gateway.http().post("/anthropic/v1/messages/count_tokens", json={"model": UP, "messages": turns})
    assert counted.status_code == 400 and f"'{UP}' is served by upstream 'a', 'b'" in counted.json()["error"]["message"]


def test_a_message_batch_relays_its_upstream_requests(fleet: dict[str, Any]) -> None:
    """A Message Batch whose requests name the resident model and an upstream one: each result is the synchronous
    answer (the upstream's requests relayed as chat requests, a tool call included)."""
    claude = anthropic.Anthropic(base_url=fleet["gateway"].base_url + "/anthropic", api_key="k", max_retries=0)
    closed = {"name": "f", "input_schema": NO_ARGUMENTS}
    params: list[dict[str, Any]] = [
        {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": f"Row {i}"}], "temperature": 0}
        for i, model in enumerate(["tiny", UP, UP])
    ]
    params.append({**params[1], "max_tokens": 24, "tools": [closed], "tool_choice": {"type": "any"}})
    created = claude.messages.batches.create(
        requests=[{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)]
    )  # type: ignore[misc]
    wait_for(lambda: claude.messages.batches.retrieve(created.id).processing_status == "ended", timeout=300)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(created.id)}
    http = fleet["gateway"].http()
    for i, p in enumerate(params):
        result = results[f"m{i}"]
        assert result.type == "succeeded", result
        sync = http.post("/anthropic/v1/messages", json=p).json()
        got = result.message.model_dump(exclude_none=True)
        # each call has its own id
        blocks = [[{k: v for k, v in b.items() if k != "id"} for b in m["content"]] for m in (got, sync)]
        assert blocks[0] == blocks[1] and (got["usage"], got["stop_reason"]) == (sync["usage"], sync["stop_reason"])
    assert results["m3"].message.stop_reason == "tool_use"  # type: ignore[union-attr]


def test_responses_on_an_upstream_model_go_through_its_chat_route(fleet: dict[str, Any], client: openai.OpenAI) -> None:
    """A Responses request naming an upstream model is its chat request sent to the upstream's
    ``/v1/chat/completions``, the answer translated back: the same text as the equivalent chat request (sync, stream,
    a batch line, a ``previous_response_id`` chain), a forced function call as a ``function_call`` item."""
    direct = fleet["a"].http()

    def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"model": UP, "messages": messages, "max_completion_tokens": 16, "temperature": 0, **extra}
        answer = direct.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]  # type: ignore[no-any-return]

    ask = {"model": UP, "max_output_tokens": 16, "temperature": 0}
    raw = client.responses.with_raw_response.create(input="Name a colour.", **ask)  # type: ignore[arg-type]
    first = raw.parse()
    assert raw.headers["x-millm-backend"] in ("upstream:a", "upstream:b") and first.model == UP
    text = chat([{"role": "user", "content": "Name a colour."}])["message"]["content"]
    assert first.output_text == text and first.usage is not None and first.usage.output_tokens > 0
    events = list(client.responses.create(input="Name a colour.", stream=True, **ask))  # type: ignore[arg-type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text  # type: ignore[union-attr]
    assert events[-1].response.output_text == text  # type: ignore[union-attr]
    chained = client.responses.create(input="And another?", previous_response_id=first.id, **ask)  # type: ignore[arg-type]
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And another?"},
    ]
    assert chained.output_text == chat(turns)["message"]["content"]
    # a forced call of a tool that takes no arguments (the random tiny model cannot run away in them)
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    tool = {"type": "function", "name": "f", "parameters": closed}
    for stream in (False, True):
        body = {
            **ask,
            "input": "hi",
            "tools": [tool],
            "tool_choice": "required",
            "stream": stream,
            "max_output_tokens": 24,
        }
        if stream:
            streamed = list(client.responses.create(**body))  # type: ignore[call-overload]
            assert "response.function_call_arguments.done" in [e.type for e in streamed]
            called = streamed[-1].response
        else:
            called = client.responses.create(**body)  # type: ignore[call-overload]
        (call,) = called.output
        assert call.type == "function_call" and call.name == "f" and json.loads(call.arguments) == {}
        assert call.call_id.startswith("call_") and called.status == "completed"
    # batch lines (upstream ones, a chained one, a tool call, and one of the resident model) answer as the route
    rows = {
        "r0": {"input": "Name a colour.", **ask},
        "r1": {"input": "And another?", "previous_response_id": first.id, **ask},
        "r2": {**ask, "input": "hi", "tools": [tool], "tool_choice": "required", "max_output_tokens": 24},
        "r3": {**ask, "model": "tiny", "input": "Name a colour."},
    }
    lost = {"input": "Go on.", "previous_response_id": "resp_gone", **ask}  # fails when its row runs, as the route
    lines = [line(name, body, url="/v1/responses") for name, body in [*rows.items(), ("lost", lost)]]
    done = wait_terminal(client, submit(client, jsonl(lines), endpoint="/v1/responses").id)
    assert done.status == "completed", done.errors
    out = {o["custom_id"]: o["response"] for o in read_lines(client, done.output_file_id)}
    assert sorted(out) == sorted(rows)
    (failed,) = read_lines(client, done.error_file_id)
    refused = fleet["gateway"].http().post("/v1/responses", json=lost)
    assert failed["custom_id"] == "lost" and failed["response"]["status_code"] == refused.status_code == 400
    assert failed["response"]["body"]["error"] == refused.json()["error"]
    assert refused.json()["error"]["code"] == "previous_response_not_found"
    for name, body in rows.items():
        sync = fleet["gateway"].http().post("/v1/responses", json={"model": UP, **body})
        assert out[name]["status_code"] == sync.status_code == 200 and _answer(out[name]["body"]) == _answer(
            sync.json()
        )
    assert out["r0"]["body"]["output"][0]["content"][0]["text"] == text
    assert out["r2"]["body"]["output"][0]["type"] == "function_call"


def _answer(response: dict[str, Any]) -> dict[str, Any]:
    """A Response but for its ids and times."""
    output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    kept = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}
    return {**kept, "output": output}


def test_503_is_retried_with_one_request_id_until_it_recovers(fleet: dict[str, Any], client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(**chat_body("hello", model="flaky"))
    assert answer.choices[0].message.content == "echo: hello" and answer.model == "flaky"
    ids = (fleet["root"] / "flaky.requests").read_text().split()
    assert len(ids) == 3 and len(set(ids)) == 1  # two 503s, then the answer: one X-Request-Id
    assert str(uuid.UUID(ids[0], version=4)) == ids[0]  # a UUID: llama-cpp-python's server refuses anything else


def test_a_slow_upstream_ends_at_the_total_timeout(client: openai.OpenAI) -> None:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**chat_body("hi", model="slow"))
    assert caught.value.status_code == 504
    assert caught.value.body["code"] == "upstream_timeout"  # type: ignore[index]
    assert time.monotonic() - started < 20  # not the 30 s the upstream takes


def test_a_two_model_file_completes_in_input_order(client: openai.OpenAI) -> None:
    rows = [line(f"r{i}", chat_body(f"Row {i}", model=UP if i % 2 else "tiny", temperature=0)) for i in range(8)]
    done = wait_terminal(client, submit(client, jsonl(rows)).id)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (8, 0)
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(8)]
    backends = [x["response"]["millm"]["headers"]["X-miLLM-Backend"] for x in out]
    assert backends[0::2] == ["serial"] * 4 and all(b.startswith("upstream:") for b in backends[1::2])
    assert {x["response"]["body"]["model"] for x in out} == {"tiny", UP}


def test_a_line_naming_a_model_nobody_serves_fails_the_batch_at_validation(client: openai.OpenAI) -> None:
    rows = [line(f"r{i}", chat_body(f"Row {i}", model=UP if i % 2 else "tiny")) for i in range(4)]
    rows.insert(3, line("nobody", chat_body("hi", model="nobody")))
    done = wait_terminal(client, submit(client, jsonl(rows)).id)
    assert done.status == "failed" and done.in_progress_at is None and done.output_file_id is None
    assert done.errors is not None and done.errors.data
    (entry,) = done.errors.data  # one entry per invalid line, nothing else (OpenAI's shape)
    assert (entry.line, entry.code, entry.param) == (4, "model_not_found", "body.model")
    assert "'nobody'" in (entry.message or "") and f"'{UP}'" in (entry.message or "")  # upstream models listed
    counts = done.request_counts
    assert counts is not None and counts.completed == 0 and counts.total == 5
    # every line is accounted for: the invalid one with its error, the valid ones never ran because the batch
    # failed (nobody cancelled it)
    errors = read_lines(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("r0", "batch_failed"),
        ("r1", "batch_failed"),
        ("r2", "batch_failed"),
        ("nobody", "model_not_found"),
        ("r3", "batch_failed"),
    ]


def test_an_upstream_batch_has_an_eta_from_its_own_progress(client: openai.OpenAI) -> None:
    """A batch on an upstream pool gets ``millm.estimated_completion_at`` from its own rate so far (pools run side
    by side and do not share the resident engine's measured rate; it stayed null)."""
    rows = [line(f"e{i}", chat_body(f"Row {i}", model="gone")) for i in range(12)]  # one at a time, 0.3 s each
    batch = submit(client, jsonl(rows))

    def estimated() -> Any:
        b = client.batches.retrieve(batch.id)
        eta = (b.model_extra or {}).get("millm", {}).get("estimated_completion_at")
        return b.status == "in_progress" and eta is not None and (b, eta)

    running, eta = wait_for(estimated, timeout=120)
    counts = running.request_counts
    assert counts is not None and 0 < counts.completed < 12
    assert running.in_progress_at is not None and running.in_progress_at < eta <= running.expires_at
    assert wait_terminal(client, batch.id).status == "completed"


def test_a_batch_that_expires_while_its_pool_is_down(fleet: dict[str, Any], client: openai.OpenAI) -> None:
    rows = [line(f"g{i}", chat_body(f"g{i}", model="gone")) for i in range(12)]
    batch = submit(client, jsonl(rows))
    wait_for(lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.completed >= 2)
    fleet["gone"].kill9()
    waiting = wait_for(
        lambda: (
            (b := client.batches.retrieve(batch.id)).model_extra["millm"]["waiting_reason"]  # type: ignore[index]
            == "upstream_unavailable"
            and b
        )
    )
    assert waiting.status == "in_progress"
    with pytest.raises(openai.APIStatusError) as caught:  # a synchronous request is told at once
        client.chat.completions.create(**chat_body("hi", model="gone"))
    assert caught.value.status_code == 503 and caught.value.body["code"] == "upstream_unavailable"  # type: ignore[index]
    assert "'gone'" in caught.value.message
    # the detailed health names every upstream and which ones answer (no keys here: the caller is an admin)
    health = {u["name"]: u for u in fleet["gateway"].http().get("/api/health/detailed").json()["upstreams"]}
    assert set(health) == {"a", "b", *FAKES}
    assert health["gone"]["live"] is False and health["gone"]["url"].startswith(fleet["gone"].base_url)
    assert health["a"]["live"] is True and health["a"]["models"] == [UP] and health["a"]["max_in_flight"] == 2
    with sqlite3.connect(fleet["root"] / "gateway" / "miserver.db", timeout=30) as db:  # time passes: it is due
        db.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (int(time.time()), batch.id))
    done = wait_terminal(client, batch.id)
    assert done.status == "expired"
    out, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert len(out) >= 2 and len(out) + len(errors) == 12
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(x["custom_id"] for x in out + errors) == sorted(f"g{i}" for i in range(12))


def test_rows_of_a_live_pool_run_while_those_of_a_down_pool_wait(client: openai.OpenAI) -> None:
    """The pool of the file's first rows (and of the batch's model, ``gone``: killed by the test above) is down: the
    rows of the live pool behind them run; the batch waits ``upstream_unavailable`` once only the down pool's rows
    are left, and its output keeps the input order."""
    rows = [line(f"d{i}", chat_body(f"d{i}", model="gone")) for i in range(3)]
    rows += [line(f"u{i}", chat_body(f"Row {i}", model=UP, max_tokens=4, temperature=0)) for i in range(4)]
    batch = submit(client, jsonl(rows))

    def unavailable() -> Any:
        b = client.batches.retrieve(batch.id)
        return b.model_extra is not None and b.model_extra["millm"]["waiting_reason"] == "upstream_unavailable" and b

    waiting = wait_for(unavailable, timeout=180)
    assert waiting.status == "in_progress" and waiting.model == "gone"
    counts = waiting.request_counts
    assert counts is not None and (counts.completed, counts.failed) == (4, 0)
    client.batches.cancel(batch.id)
    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled"
    out, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"u{i}" for i in range(4)]
    assert [e["custom_id"] for e in errors] == [f"d{i}" for i in range(3)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_an_upstream_killed_mid_batch_loses_nothing(fleet: dict[str, Any], client: openai.OpenAI) -> None:
    rows = [line(f"k{i:02d}", chat_body(f"Row {i}", model=UP, max_tokens=4, temperature=0)) for i in range(16)]
    batch = submit(client, jsonl(rows))
    wait_for(lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.completed >= 2)
    fleet["a"].kill9()
    done = wait_terminal(client, batch.id, timeout=180)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None and done.request_counts.completed == 16
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"k{i:02d}" for i in range(16)]  # each once, in input order
    assert "upstream:b" in {x["response"]["millm"]["headers"]["X-miLLM-Backend"] for x in out}
    after = client.chat.completions.create(**chat_body("still there?", model=UP))
    assert after.model == UP
