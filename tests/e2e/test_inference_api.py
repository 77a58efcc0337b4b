"""Synchronous inference end to end (DESIGN §3.4): models, chat and text completions, streaming, provenance, errors.

The database plays no part here, so the module shares one SQLite server (``sqlite_module_server``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import QUANTIZED_ID
from tests.support.batches import api_error, error_of
from tests.support.server import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(sqlite_module_server: ServerProcess) -> ServerProcess:
    return sqlite_module_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def test_models_list(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model"
    assert client.models.retrieve("tiny").id == "tiny"
    r = server.http().get("/v1/models")
    assert r.status_code == 200 and r.headers["x-request-id"]
    assert api_error(client.models.retrieve, "Tiny").status_code == 404, "ids compare case-sensitively"


# -- non-streaming ---------------------------------------------------------------------------------------------


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage is not None
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_text_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=5)
    assert r.object == "text_completion"
    assert r.model == "tiny"
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].text
    assert r.usage is not None and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    several = client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=2, seed=1)
    assert [c.index for c in several.choices] == [0, 1, 2]
    ids = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=2)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_length_limit(client: openai.OpenAI, field: str) -> None:
    for limit in (1, 7):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=3, **{field: limit})  # type: ignore[arg-type]
        assert r.usage is not None
        assert 1 <= r.usage.completion_tokens <= limit
        if r.usage.completion_tokens == limit:
            assert r.choices[0].finish_reason == "length"


def test_completion_length_limit(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, seed=3)
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 6
    if r.usage.completion_tokens == 6:
        assert r.choices[0].finish_reason == "length"


def test_same_seed_same_output(client: openai.OpenAI) -> None:
    def chat(seed: int) -> str:
        r = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=1.0,
            seed=seed,  # type: ignore[arg-type]
        )
        return r.choices[0].message.content or ""

    def text(seed: int) -> str:
        created = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=1.0, seed=seed)
        return created.choices[0].text

    assert chat(5) == chat(5)
    assert text(5) == text(5)
    # ... and the seed matters (12 tokens from a 49k vocabulary: a collision is practically impossible)
    assert chat(5) != chat(6)
    assert text(5) != text(6)


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, seed=9)  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage is not None
    single = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, seed=9)  # type: ignore[arg-type]
    assert single.usage is not None
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert 2 <= r.usage.completion_tokens <= 8, "usage counts the tokens of both choices"
    if all(c.finish_reason == "length" for c in r.choices):
        assert r.usage.completion_tokens == 8
    t = client.completions.create(model="tiny", prompt="x", max_tokens=3, n=2, seed=9)
    assert [c.index for c in t.choices] == [0, 1]


def test_stop(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": 17}
    full = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    assert len(full) > 8
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    stopped = client.chat.completions.create(**kwargs, stop=[stop, "\u2603never"])
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"

    tk: dict[str, Any] = {"model": "tiny", "prompt": "Once", "max_tokens": 24, "temperature": 1.0, "seed": 17}
    text = client.completions.create(**tk).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    t = client.completions.create(**tk, stop=stop)
    assert t.choices[0].text == text[: text.index(stop)]
    assert t.choices[0].finish_reason == "stop"


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=4,
        seed=2,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert r.usage is not None and len(lp.content) == r.usage.completion_tokens
    for token in lp.content:
        assert token.logprob <= 0.0
        assert token.bytes == list(token.token.encode("utf-8"))
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert token.logprob <= values[0] + 1e-6
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    no_top = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True)  # type: ignore[arg-type]
    assert no_top.choices[0].logprobs is not None and no_top.choices[0].logprobs.content is not None
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)
    exc = api_error(client.chat.completions.create, model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=2)
    assert exc.status_code == 400 and error_of(exc)["param"] == "top_logprobs"


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=5, seed=2, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert r.usage is not None
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0.0
        assert top is not None and 1 <= len(top) <= 3
    exc = api_error(client.completions.create, model="tiny", prompt="x", max_tokens=1, logprobs=21)
    assert exc.status_code == 400 and error_of(exc)["param"] == "logprobs"


# -- streaming -------------------------------------------------------------------------------------------------


def test_streaming_chat_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 31}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks, "no chunks"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and full.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
        full.usage.total_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == text


def test_streaming_completion_equals_non_streamed(client: openai.OpenAI, server: ServerProcess) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "Once upon", "max_tokens": 10, "temperature": 1.0, "seed": 32}
    full = client.completions.create(**kwargs)
    # Like OpenAI's own stream, the chunks before the last carry "finish_reason": null, which the SDK's
    # CompletionChoice type (finish_reason: Literal["stop", "length", "content_filter"]) refuses in strict
    # validation; so this stream is read with the SDK in its default, non-strict mode.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0) as lenient:
        chunks = list(lenient.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2]), "only the last choice chunk finishes"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and full.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]


def test_streaming_response_headers(client: openai.OpenAI) -> None:
    with client.chat.completions.with_streaming_response.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        seed=5,
        stream=True,  # type: ignore[arg-type]
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-millm-seed"] == '5;scope="request"'
        assert response.headers["x-millm-model"] == "tiny"
        assert response.headers["x-request-id"]
        assert list(response.iter_lines())


# -- provenance ------------------------------------------------------------------------------------------------


def test_provenance_headers(client: openai.OpenAI, server: ServerProcess) -> None:
    seeded = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        seed=5,  # type: ignore[arg-type]
    )
    h = seeded.headers
    assert h["x-millm-model"] == "tiny"
    assert h["x-millm-backend"] == "serial"
    assert h["x-millm-seed"] == '5;scope="request"'
    assert h["x-millm-weights"]
    assert h["x-millm-dtype"] in ("float32", "bfloat16", "float16")
    assert h["x-request-id"]
    health = server.http().get("/api/health/detailed").json()
    assert h["x-millm-weights"] == health["model"]["weights_revision"]
    assert h["x-millm-dtype"] == health["model"]["dtype"]

    unseeded = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    seed, scope = unseeded.headers["x-millm-seed"].split(";")
    assert scope == 'scope="server"'
    assert int(seed) >= 0
    assert unseeded.headers["x-millm-weights"] == h["x-millm-weights"]
    assert unseeded.headers["x-request-id"] != h["x-request-id"]

    # The server seed named in the header reproduces the response when sent as the request's seed.
    text = unseeded.parse().choices[0].text
    again = client.completions.create(model="tiny", prompt="x", max_tokens=1, seed=int(seed))
    assert again.choices[0].text == text


def test_request_id_on_every_response(server: ServerProcess) -> None:
    http = server.http()
    for method, path, kwargs in (
        ("GET", "/api/health", {}),
        ("GET", "/v1/models", {}),
        ("GET", "/v1/files", {}),
        ("GET", "/v1/no-such-route", {}),
        ("POST", "/v1/chat/completions", {"content": b"{oops"}),
        ("POST", "/v1/chat/completions", {"json": {"model": "nope", "messages": MESSAGES}}),
    ):
        r = http.request(method, path, **kwargs)
        assert r.headers.get("x-request-id"), (method, path, r.status_code)


# -- errors ----------------------------------------------------------------------------------------------------


def _assert_error(exc: openai.APIStatusError, status: int, code: str | None, param: str | None) -> dict[str, Any]:
    assert exc.status_code == status, (exc.status_code, exc.body)
    err = error_of(exc)
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert exc.response.headers["x-request-id"]
    return err


def test_unknown_model_404(client: openai.OpenAI) -> None:
    for call in (
        lambda: client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1),  # type: ignore[arg-type]
        lambda: client.completions.create(model="nope", prompt="x", max_tokens=1),
        lambda: client.chat.completions.create(model="TINY", messages=MESSAGES, max_tokens=1),  # type: ignore[arg-type]
    ):
        err = _assert_error(api_error(call), 404, "model_not_found", "model")
        assert "tiny" in err["message"]


def test_model_prefix_message_names_exact_id(quantized_server: ServerProcess) -> None:
    client = quantized_server.client()
    prefix = QUANTIZED_ID.split(":")[0]
    for call in (
        lambda: client.chat.completions.create(model=prefix, messages=MESSAGES, max_tokens=1),  # type: ignore[arg-type]
        lambda: client.completions.create(model=prefix, prompt="x", max_tokens=1),
    ):
        err = _assert_error(api_error(call), 404, "model_not_found", "model")
        assert QUANTIZED_ID in err["message"], err
    assert [m.id for m in client.models.list().data] == [QUANTIZED_ID]
    ok = client.chat.completions.with_raw_response.create(model=QUANTIZED_ID, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert ok.headers["x-millm-model"] == QUANTIZED_ID
    assert ok.parse().model == QUANTIZED_ID


def test_missing_and_wrongly_typed_fields(client: openai.OpenAI, server: ServerProcess) -> None:
    http = server.http()
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("missing_required_parameter", "messages")
    r = http.post("/v1/completions", json={"model": "tiny"})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("missing_required_parameter", "prompt")
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"

    wrong: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3.5}, "temperature"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ]
    for override, param in wrong:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **override}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (override, r.status_code, r.text)
        assert r.json()["error"]["param"] == param, (override, r.text)
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages[0]"), r.text
    r = http.post("/v1/chat/completions", json=["not", "an", "object"])
    assert r.status_code == 400, r.text


def test_unknown_field_ignored_unless_strict(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"frobnicate": True},  # type: ignore[arg-type]
    )
    assert r.choices
    t = client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"frobnicate": True})
    assert t.choices
    exc = api_error(
        client.chat.completions.create,
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"frobnicate": True},
        extra_headers={"X-miLLM-Strict": "true"},
    )
    _assert_error(exc, 400, "unknown_parameter", "frobnicate")
    exc = api_error(
        client.completions.create,
        model="tiny",
        prompt="x",
        max_tokens=1,
        extra_body={"frobnicate": True},
        extra_headers={"X-miLLM-Strict": "true"},
    )
    _assert_error(exc, 400, "unknown_parameter", "frobnicate")
    # a nested unknown field is named by its path
    exc = api_error(
        client.chat.completions.create,
        model="tiny",
        max_tokens=1,
        messages=[{"role": "user", "content": "x", "colour": "red"}],  # type: ignore[list-item]
        extra_headers={"X-miLLM-Strict": "true"},
    )
    _assert_error(exc, 400, "unknown_parameter", "messages[0].colour")


def test_unsupported_parameters(client: openai.OpenAI) -> None:
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    for kwargs, param in (
        ({"functions": functions}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ):
        for headers in (None, {"X-miLLM-Strict": "true"}):  # refused in both modes
            exc = api_error(
                client.chat.completions.create,
                model="tiny",
                messages=MESSAGES,
                max_tokens=1,
                extra_headers=headers,
                **kwargs,
            )
            _assert_error(exc, 400, "unsupported_parameter", param)


def test_invalid_json_body(server: ServerProcess) -> None:
    http = server.http()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/batches"):
        r = http.post(path, content=b'{"model": "tiny", ', headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"]


def test_a_body_over_the_request_limit_is_a_413_before_it_is_kept(server: ServerProcess) -> None:
    """A JSON body over ``MISERVER_MAX_REQUEST_BYTES`` (1 MiB by default, a batch line's limit) is refused with 413
    ``request_too_large`` on every JSON route, whether its length is declared or it comes in chunks: it is never
    decoded nor tokenized (a 5 MB chat once held every client for 5 s, and 100 MB ran the server out of memory)."""
    http = server.http()
    content = "a " * 600_000
    bodies = {
        "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1},
        "/v1/completions": {"model": "tiny", "prompt": content, "max_tokens": 1},
        "/v1/responses": {"model": "tiny", "input": content, "max_output_tokens": 16},
        "/v1/embeddings": {"model": "tiny", "input": content},
        "/v1/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "metadata": {"k": content}},
    }
    for path, body in bodies.items():
        raw = json.dumps(body).encode()
        assert len(raw) > 1_048_576
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "MISERVER_MAX_REQUEST_BYTES" in err["message"], (path, err)
    raw = json.dumps(bodies["/v1/chat/completions"]).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for start in range(0, len(raw), 65_536):
            yield raw[start : start + 65_536]

    r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    # just under the limit, the route reads it and answers as before
    under = {"model": "tiny", "messages": [{"role": "user", "content": "a " * 500_000}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=under)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    exc = api_error(client.chat.completions.create, model="tiny", messages=MESSAGES, max_tokens=600)
    err = _assert_error(exc, 400, "context_length_exceeded", "messages")
    assert "512" in err["message"]
    long_prompt = "word " * 600
    exc = api_error(client.completions.create, model="tiny", prompt=long_prompt, max_tokens=1)
    err = _assert_error(exc, 400, "context_length_exceeded", "prompt")
    assert "512" in err["message"]
    exc = api_error(client.chat.completions.create, model="tiny", messages=[{"role": "user", "content": long_prompt}])
    _assert_error(exc, 400, "context_length_exceeded", "messages")


IMAGE_PART = {"type": "image_url", "image_url": {"url": "x"}}


def test_never_a_500(server: ServerProcess) -> None:
    """A sweep of malformed requests: every answer is a 4xx with the OpenAI envelope, never a 5xx."""
    http = server.http()
    bodies: list[Any] = [
        None,
        1,
        "x",
        [],
        {},
        {"model": None},
        {"model": "tiny", "messages": None},
        {"model": "tiny", "messages": [{}]},
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        {"model": "tiny", "messages": [{"role": "user", "content": [IMAGE_PART]}]},
        {"model": "tiny", "messages": MESSAGES, "max_tokens": -1},
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 0},
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 10**12},
        {"model": "tiny", "messages": MESSAGES, "top_p": 2},
        {"model": "tiny", "messages": MESSAGES, "seed": "s"},
        {"model": "tiny", "messages": MESSAGES, "stream_options": {"include_usage": "yes"}},
        {"model": "tiny", "messages": MESSAGES, "top_logprobs": 50, "logprobs": True},
    ]
    for body in bodies:
        r = http.post("/v1/chat/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text
    text_bodies: list[Any] = [
        {"model": "tiny", "prompt": []},
        {"model": "tiny", "prompt": [[]]},
        {"model": "tiny", "prompt": [10**9]},
        {"model": "tiny", "prompt": [-1]},
        {"model": "tiny", "prompt": [1.5]},
        {"model": "tiny", "prompt": "x", "n": 0},
        {"model": "tiny", "prompt": "x", "suffix": "y"},
        {"model": "tiny", "prompt": "x", "best_of": 3},
        {"model": "tiny", "prompt": "x", "logprobs": 21},
    ]
    for body in text_bodies:
        r = http.post("/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text
