"""Headers made from user text can carry any text (RFC 6266 / 5987 for file names, percent-encoding for the rest),
and a handler error never costs the client its keep-alive connection."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import unquote

import httpx
import pytest
from fastapi import FastAPI

from miserver.api.common import to_response
from miserver.app import ServerErrors
from miserver.http_headers import content_disposition, header_value
from miserver.services.inference.context import ServiceResult

NAMES = ["données_測試_😀.jsonl", 'a "quoted"\r\nname.jsonl', "測試.jsonl", "%41 already.jsonl", "\u00e9"]


#: ``attachment; filename="<fallback>"`` and, optionally, ``; filename*=UTF-8''<RFC 5987 attr-chars>``
DISPOSITION = r'attachment; filename="([^"\\\r\n]*)"' + r"(?:; filename\*=UTF-8''([A-Za-z0-9!#$&+\-.^_`|~%]+))?"


def parse(value: str) -> tuple[str, str | None]:
    """``(fallback, filename*)`` of a Content-Disposition value as this module writes it."""
    m = re.fullmatch(DISPOSITION, value)
    assert m, value
    return m.group(1), unquote(m.group(2)) if m.group(2) else None


def test_a_plain_name_is_sent_as_it_is() -> None:
    assert content_disposition("input.jsonl") == 'attachment; filename="input.jsonl"'


@pytest.mark.parametrize("name", NAMES)
def test_any_name_travels_in_the_header_and_comes_back_whole(name: str) -> None:
    value = content_disposition(name)
    value.encode("latin-1")  # what Starlette does with a header: it must not raise
    fallback, full = parse(value)
    assert fallback.isascii() and fallback
    assert full == name


def test_the_fallback_keeps_what_ascii_can_say() -> None:
    assert parse(content_disposition("données.jsonl"))[0] == "donnees.jsonl"
    assert parse(content_disposition("測試"))[0] == "download"


@pytest.mark.parametrize("text", ["tiny", "模型/中文", "line\r\nX-Injected: 1", "100%"])
def test_a_header_value_is_printable_ascii_and_decodes_back(text: str) -> None:
    value = header_value(text)
    assert re.fullmatch(r"[\x20-\x7e]*", value)
    assert value == text if re.fullmatch(r"[\x20-\x7e]*", text) else unquote(value) == text


def test_a_provenance_header_from_a_model_id_in_any_script_is_sent() -> None:
    """A catalogue id or checkpoint name is user text and becomes ``X-miLLM-Model``: the response is built."""
    response = to_response(ServiceResult(200, {"ok": True}, {"X-miLLM-Model": "模型-😀"}))
    assert unquote(response.headers["x-millm-model"]) == "模型-😀"


def _app() -> FastAPI:
    """An application like miServer's: ServerErrors outside, and a mounted application (as the console is) with
    Starlette's own last-resort handler, which sends its 500 and then re-raises."""
    app = FastAPI()
    app.add_middleware(ServerErrors)
    sub = FastAPI()

    @sub.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a handler fault")

    @app.get("/boom")
    async def top_boom() -> None:
        raise RuntimeError("a handler fault")

    app.mount("/sub", sub)
    return app


@pytest.mark.parametrize("path", ["/boom", "/sub/boom"])
def test_a_handler_error_is_a_500_and_the_exception_goes_no_further(path: str) -> None:
    """uvicorn closes the connection when the application raises; the raise is what this asserts is gone
    (httpx's ASGI transport raises it as uvicorn would see it)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    response = asyncio.run(go())
    assert response.status_code == 500


def test_a_stream_cut_short_still_raises() -> None:
    """A response that started and cannot be finished: only closing the connection tells the client."""

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"part", "more_body": True})  # type: ignore[operator]
        raise RuntimeError("cut")

    async def go() -> None:
        transport = httpx.ASGITransport(app=ServerErrors(app))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.get("/")

    with pytest.raises(RuntimeError, match="cut"):
        asyncio.run(go())
