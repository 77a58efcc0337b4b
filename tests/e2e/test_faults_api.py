"""Issue 10 over HTTP: unpaired surrogates on every route and in a batch file, an internal error that leaves the
keep-alive connection usable, trailing slashes, repeated multipart parts, image parts, a wrongly typed ``stop``.

The server is the real application under uvicorn, in this process (a thread of its own), with the tiny model on
SQLite: the test can reach the engine to inject an internal error, and the HTTP connection is a real one.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from miserver.app import create_app
from miserver.settings import Settings
from tests.support.batches import line, read_lines, submit, wait_terminal
from tests.support.server import wait_for

USER = [{"role": "user", "content": "hi"}]


class InProcessServer:
    """The application under uvicorn in a thread; ``url`` once started."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=120)
        assert self.server.started, "the in-process server did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.host, self.port = "127.0.0.1", port
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    data = tmp_path_factory.mktemp("faults")
    settings = Settings(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        data_dir=data,
        database_url=f"sqlite:///{data / 'db'}",
        batch_poll_seconds=0.05,
    )
    with InProcessServer(create_app(settings)) as server:
        yield server


@pytest.fixture
def http(served: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


@pytest.fixture
def sdk(served: InProcessServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="test", max_retries=0) as client:
        yield client


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON body written by hand (so that ``\\ud800`` travels as the JSON escape, in plain ASCII)."""
    return http.post(path, content=text.encode("ascii"), headers={"content-type": "application/json"})


def error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]  # type: ignore[no-any-return]


def invalid_value_message(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> str:
    """POST ``body`` written by hand; assert a 400 ``invalid_value`` naming ``param``; return the error's message."""
    response = post_raw(http, path, json.dumps(body))
    assert response.status_code == 400, response.text
    err = error(response)
    assert (err["code"], err["param"]) == ("invalid_value", param), err
    return err["message"]  # type: ignore[no-any-return]


# -- §1 an internal error is an ordinary JSON 500 ---------------------------------------------------------------------


def _raw_exchange(host: str, port: int, requests: list[bytes]) -> list[bytes]:
    """Send each request on ONE TCP connection, reading each response (Content-Length framed) before the next."""

    async def run() -> list[bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        out = []
        try:
            for request in requests:
                writer.write(request)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
                )
                out.append(head + await reader.readexactly(length))
        finally:
            writer.close()
        return out

    return asyncio.run(run())


def test_an_internal_error_is_a_json_500_and_the_connection_stays_usable(
    served: InProcessServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = served.app.state.miserver.ctx.engine

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    body = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 1})
    monkeypatch.setattr(engine, "tokenize_chat", broken)
    first = post_raw(http, "/v1/chat/completions", body)
    assert first.status_code == 500 and first.headers["content-type"] == "application/json"
    assert error(first)["type"] == "server_error" and "injected" not in first.text
    assert first.headers.get("x-request-id")
    second = http.get("/v1/models")  # the same client, the same keep-alive connection
    assert second.status_code == 200 and second.json()["data"][0]["id"] == "tiny"

    # on one raw TCP connection: the 500, then two more requests answered on it
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = _raw_exchange(served.host, served.port, [request, models, models])
    assert answers[0].startswith(b"HTTP/1.1 500") and b'"server_error"' in answers[0]
    assert answers[1].startswith(b"HTTP/1.1 200") and answers[2].startswith(b"HTTP/1.1 200")
    monkeypatch.undo()
    healed = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 1})
    assert healed.status_code == 200


# -- §1 unpaired surrogates on every route --------------------------------------------------------------------------


SUR = "\ud800"  # json.dumps writes it as the escape "\\ud800": the body is plain ASCII, valid JSON, not valid text
CHAT_BODY = {"model": "tiny", "messages": USER}
BATCH_CREATE = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "messages": [{"role": "user", "content": f"hi {SUR}"}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {**CHAT_BODY, "model": "tiny\udfff"}, "model"),
        ("/v1/chat/completions", {**CHAT_BODY, "stop": ["a", SUR]}, "stop[1]"),
        ("/v1/chat/completions", {**CHAT_BODY, "user": SUR}, "user"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", f"{SUR}b"]}, "prompt[1]"),
        ("/v1/embeddings", {"model": "tiny", "input": ["a", "b", "\udc00"]}, "input[2]"),
        ("/api/probes/score", {"probe": "p", "input": SUR}, "input"),
        ("/api/probes", {"name": "p", "layer": 1, "texts": ["a", SUR], "labels": [0, 1]}, "texts[1]"),
        ("/v1/batches", {**BATCH_CREATE, "metadata": {"k": f"v{SUR}"}}, "metadata.k"),
        ("/api/lease", {"holder": f"me{SUR}", "ttl_seconds": 60}, "holder"),
        ("/api/models/load", {"model": SUR}, "model"),
    ],
)
def test_unpaired_surrogates_are_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert "unpaired surrogate" in invalid_value_message(http, path, body, param)


def test_a_field_name_with_a_surrogate_and_a_body_nested_too_deeply(http: httpx.Client) -> None:
    r = post_raw(http, "/v1/chat/completions", json.dumps({**CHAT_BODY, f"x{SUR}": 1}))
    assert r.status_code == 400 and error(r)["param"] == "x\\ud800" and "field name" in error(r)["message"]
    r = post_raw(http, "/v1/chat/completions", "[" * 100_000 + "]" * 100_000)
    assert r.status_code == 400 and error(r)["code"] == "invalid_json"


def test_a_batch_line_with_a_surrogate_custom_id_fails_alone(sdk: openai.OpenAI) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 2}
    data = "".join(
        json.dumps(x) + "\n"  # ensure_ascii: the surrogates travel as escapes, the file is valid UTF-8
        for x in [
            line("r1", body),
            line("sur\udc00id", body),
            line("r3", body),
            line("r4", {**body, "messages": [{"role": "user", "content": "bad \ud800 text"}]}),
        ]
    ).encode("ascii")
    batch = wait_terminal(sdk, submit(sdk, data).id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 2, 2)
    assert [x["custom_id"] for x in read_lines(sdk, batch.output_file_id)] == ["r1", "r3"]
    errors = read_lines(sdk, batch.error_file_id)
    assert [x["millm"]["line"] for x in errors] == [2, 4]
    assert errors[0]["custom_id"] is None and errors[1]["custom_id"] == "r4"
    params = [x["response"]["body"]["error"]["param"] for x in errors]
    assert params == ["custom_id", "body.messages[0].content"]  # a body field as OpenAI's Batch API names it
    assert batch.errors is not None and [(e.line, e.param) for e in batch.errors.data or []] == [
        (2, "custom_id"),
        (4, "body.messages[0].content"),
    ]


# -- §5 error params over HTTP -------------------------------------------------------------------------------------


def test_image_part_and_wrongly_typed_stop(http: httpx.Client) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    content = [{"type": "text", "text": "what is this?"}, image]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": content}]})
    err = error(r)
    assert r.status_code == 400 and err["param"] == "messages[0].content[1].type"
    assert "image content" in err["message"] and "not supported by this model" in err["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "stop": 5})
    err = error(r)
    assert r.status_code == 400 and err["param"] == "stop"
    assert "'stop'" in err["message"] and "a string or a list of up to 4 strings" in err["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{**USER[0], "name": "Alice"}]})
    assert r.status_code == 400
    assert (error(r)["code"], error(r)["param"]) == ("unsupported_parameter", "messages[0].name")
    for value in ({}, {"type": "bogus"}):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "response_format": value})
        assert r.status_code == 400
        assert (error(r)["code"], error(r)["param"]) == ("invalid_value", "response_format.type")


# -- §6 smaller edges ---------------------------------------------------------------------------------------------


def test_trailing_slash_answers_as_without_it(http: httpx.Client) -> None:
    plain, slashed = http.get("/v1/files"), http.get("/v1/files/")
    assert slashed.status_code == plain.status_code == 200
    assert slashed.json()["object"] == "list"
    create = {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    plain, slashed = http.post("/v1/batches", json=create), http.post("/v1/batches/", json=create)
    assert slashed.status_code == plain.status_code and slashed.status_code != 307
    assert error(slashed) == error(plain)
    unknown = http.get("/v1/nothing-here/")
    assert unknown.status_code == 404 and error(unknown)["code"] == "unknown_url"


def test_two_file_parts_are_refused_naming_file(http: httpx.Client) -> None:
    before = http.get("/v1/files").json()["data"]
    files = [("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n{}\n"))]
    r = http.post("/v1/files", data={"purpose": "batch"}, files=files)
    assert r.status_code == 400 and (error(r)["param"], error(r)["code"]) == ("file", "invalid_value")
    assert "more than one 'file'" in error(r)["message"]
    assert http.get("/v1/files").json()["data"] == before  # nothing stored


# -- §7 non-finite numbers: NaN and Infinity are what Python's JSON reader accepts, and 1e999 reads as infinity ------

NAN, INF = float("nan"), float("inf")  # json.dumps writes them as the literals NaN, Infinity, -Infinity
MESSAGE = {"model": "tiny", "max_tokens": 4, "messages": USER}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT_BODY, "temperature": NAN}, "temperature"),
        ("/v1/chat/completions", {**CHAT_BODY, "top_p": INF}, "top_p"),
        ("/v1/chat/completions", {**CHAT_BODY, "presence_penalty": -INF}, "presence_penalty"),
        ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -INF}, "temperature"),
        ("/v1/responses", {"model": "tiny", "input": "a", "top_p": NAN}, "top_p"),
        ("/api/probes", {"name": "p", "layer": 1, "weights": [0.5, NAN], "bias": 0.0}, "weights[1]"),
        ("/api/probes", {"name": "p", "layer": 1, "weights": [0.5], "bias": INF}, "bias"),
        ("/api/lease", {"holder": "me", "ttl_seconds": NAN}, "ttl_seconds"),
    ],
)
def test_a_non_finite_number_is_400_saying_it_must_be_finite(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    message = invalid_value_message(http, path, body, param)
    assert message == f"Invalid value for '{param}': Input should be a finite number."


def test_a_non_finite_number_in_anthropic_and_in_batch_lines(http: httpx.Client, sdk: openai.OpenAI) -> None:
    r = post_raw(http, "/anthropic/v1/messages", json.dumps({**MESSAGE, "temperature": NAN}))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"] == "Invalid value for 'temperature': Input should be a finite number."

    good = {"model": "tiny", "messages": USER, "max_tokens": 2}
    rows = [
        line("nan", {**good, "temperature": NAN}),
        line("ok", good),
        line("inf", {**good, "top_p": INF}),
        line("big", {**good, "frequency_penalty": 1e999}),
    ]
    batch = wait_terminal(sdk, submit(sdk, "".join(json.dumps(x) + "\n" for x in rows).encode()).id)
    assert batch.status == "completed", batch.errors
    errors = read_lines(sdk, batch.error_file_id)
    assert [x["custom_id"] for x in errors] == ["nan", "inf", "big"]
    for got, param in zip(errors, ["temperature", "top_p", "frequency_penalty"], strict=True):
        assert got["response"]["status_code"] == 400
        assert got["response"]["body"]["error"]["param"] == f"body.{param}"
        assert got["error"]["message"] == f"Invalid value for '{param}': Input should be a finite number."
