"""Line validation of batch input files: each bad line gets the code, param and message a user can act on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from miserver.batches.output import failure_line, invalid_line, unrun_line
from miserver.batches.validate import check_line, physical_lines
from miserver.engines.base import EngineInfo
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference.context import ServiceContext

MODEL = "org/Model-GGUF:Q4_1"
ENDPOINT = "/v1/chat/completions"


@pytest.fixture
def ctx() -> ServiceContext:
    engine = SimpleNamespace(info=EngineInfo(MODEL, "serial", "float32", "sha256:0", 512))
    return ServiceContext(engine=engine, gate=AdmissionGate(1))  # type: ignore[arg-type]


def line(**overrides: Any) -> bytes:
    obj: dict[str, Any] = {
        "custom_id": "a",
        "method": "POST",
        "url": ENDPOINT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    obj.update(overrides)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


X = [{"role": "user", "content": "x"}]


def chat(messages: Any = X, **extra: Any) -> bytes:
    """A line whose body is a chat request for ``MODEL`` with ``messages`` and the ``extra`` fields after them."""
    return line(body={"model": MODEL, "messages": messages, **extra})


def check(
    ctx: ServiceContext, raw: bytes, seen: set[str] | None = None
) -> tuple[str | None, str | None, str | None, int | None]:
    cid, body, model, err = check_line(ctx, ENDPOINT, raw, set() if seen is None else seen)
    if err is None:
        return cid, None, model, None
    return cid, err.code, err.param, err.status_code


def test_valid_line_resolves_model(ctx: ServiceContext) -> None:
    assert check(ctx, line()) == ("a", None, MODEL, None)


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    # body fields are named as OpenAI's Batch API names them (body.<field>); the line's own fields as they are
    [
        (b"{not json", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (b"\xff\xfe{}", "invalid_encoding", None),
        (line(custom_id=...), "missing_required_parameter", "custom_id"),
        (line(custom_id=""), "invalid_value", "custom_id"),
        (line(custom_id=7), "invalid_type", "custom_id"),
        (line(method=...), "missing_required_parameter", "method"),
        (line(method="GET"), "invalid_value", "method"),
        (line(url="/v1/completions"), "invalid_url", "url"),
        (line(body=...), "missing_required_parameter", "body"),
        (line(body=[1]), "invalid_type", "body"),
        (line(extra=1), "unknown_parameter", "extra"),
        (chat(stream=True), "streaming_unsupported", "body.stream"),
        (chat(foo=1), "unknown_parameter", "body.foo"),
        (chat([{"role": "user", "content": "x", "foo": 1}]), "unknown_parameter", "body.messages[0].foo"),
        (chat([*X, {"role": "user", "content": "y", "bar": 1}]), "unknown_parameter", "body.messages[1].bar"),
        (
            chat([{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]),
            "unknown_parameter",
            "body.messages[0].content[0].foo",
        ),
        (chat(stream_options={"include_usage": True, "x": 1}), "unknown_parameter", "body.stream_options.x"),
        (chat([{"role": "user", "content": "x", "foo": 1}], zed=1), "unknown_parameter", "body.zed"),
        (line(body={"model": MODEL}), "missing_required_parameter", "body.messages"),
        (chat([{"role": "user", "content": None}]), "missing_required_parameter", "body.messages[0].content"),
        (chat(seed=2**64), "invalid_value", "body.seed"),
        (line(body={"model": MODEL, "messages": "hi"}), "invalid_type", "body.messages"),
        (chat(temperature="hot"), "invalid_type", "body.temperature"),
        (chat(temperature=3), "invalid_value", "body.temperature"),
        (chat(tools=[{"type": "function"}]), "missing_required_parameter", "body.tools[0].function"),
        (chat(functions=[{"name": "f"}]), "unsupported_parameter", "body.functions"),
        (
            line(body={"model": "other", "messages": [{"role": "user", "content": "x"}]}),
            "model_not_found",
            "body.model",
        ),
    ],
)
def test_invalid_lines(ctx: ServiceContext, raw: bytes, code: str, param: str | None) -> None:
    _, got_code, got_param, status = check(ctx, raw)
    assert (got_code, got_param) == (code, param)
    assert status == (404 if code == "model_not_found" else 400)


def test_model_prefix_names_exact_id(ctx: ServiceContext) -> None:
    body = {"model": "org/Model-GGUF", "messages": [{"role": "user", "content": "x"}]}
    _, _, _, err = check_line(ctx, ENDPOINT, line(body=body), set())
    assert err is not None and err.code == "model_not_found"
    assert f"'{MODEL}'" in err.message


def test_duplicate_custom_id(ctx: ServiceContext) -> None:
    seen: set[str] = set()
    assert check(ctx, line(), seen)[1] is None
    assert check(ctx, line(), seen)[1:3] == ("duplicate_custom_id", "custom_id")


def test_error_line_shape(ctx: ServiceContext) -> None:
    _, _, _, err = check_line(ctx, ENDPOINT, line(method="GET"), set())
    assert err is not None
    out = json.loads(invalid_line("a", 7, err))
    assert out["custom_id"] == "a" and out["millm"] == {"line": 7}
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "method"
    assert out["id"].startswith("batch_req_")
    # every error line also carries ``error: {code, message}`` (the hosted reference's shape), the same as the body's
    body_error = out["response"]["body"]["error"]
    assert out["error"] == {"code": body_error["code"], "message": body_error["message"]}


def test_every_failed_line_fills_error(ctx: ServiceContext) -> None:
    _, _, _, err = check_line(ctx, ENDPOINT, line(method="GET"), set())
    assert err is not None
    run_time = json.loads(failure_line("b", err))
    assert run_time["error"] == {"code": err.code, "message": err.message} and "millm" not in run_time
    assert run_time["response"]["body"] == err.envelope()
    for code in ("batch_cancelled", "batch_expired", "batch_failed", "insufficient_quota", "key_revoked"):
        unrun = json.loads(unrun_line("c", code))
        assert unrun["response"] is None and unrun["error"]["code"] == code and unrun["error"]["message"]


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _lines(parts: list[bytes]) -> list[tuple[int, bytes]]:
    return [x async for x in physical_lines(_chunks(parts))]


async def test_physical_lines_bom_crlf_and_split_chunks() -> None:
    got = await _lines([b"\xef\xbb\xbfone\r\ntw", b"o\n\n  \nthree"])
    assert got == [(1, b"one"), (2, b"two"), (3, b""), (4, b"  "), (5, b"three")]


async def test_physical_lines_trailing_newline_adds_no_line() -> None:
    assert await _lines([b"a\nb\n"]) == [(1, b"a"), (2, b"b")]
