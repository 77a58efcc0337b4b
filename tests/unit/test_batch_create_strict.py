"""Batch creation is a management call and always strict, as OpenAI's and Anthropic's are: an unknown field of a
``POST /v1/batches`` or ``POST /anthropic/v1/messages/batches`` body (or of an object inside it) is 400
``unknown_parameter`` naming it, whatever ``X-miLLM-Strict`` says, and nothing is created; every field the official
SDKs send is accepted.

The application runs in-process over ASGI with no resident model on SQLite.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from miserver.app import create_app
from miserver.settings import Settings

CREATE = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
REQUEST = {"custom_id": "a", "params": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[Any]:
    settings = Settings(no_model=True, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'db'}")
    application = create_app(settings)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://miserver") as c:
        yield c


@pytest.mark.parametrize("header", [{}, {"X-miLLM-Strict": "false"}])
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"colour": "blue"}, "colour"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 3600, "x": 1}}, "output_expires_after.x"),
    ],
)
async def test_an_unknown_batch_create_field_is_refused_in_every_mode(
    client: httpx.AsyncClient, header: dict[str, str], change: dict[str, Any], param: str
) -> None:
    answer = await client.post("/v1/batches", json={**CREATE, **change}, headers=header)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", param)
    assert param in error["message"]
    assert (await client.get("/v1/batches")).json()["data"] == []


@pytest.mark.parametrize("header", [{}, {"X-miLLM-Strict": "false"}])
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"requests": [REQUEST], "colour": "blue"}, "colour"),
        ({"requests": [{**REQUEST, "colour": "blue"}]}, "requests[0].colour"),
    ],
)
async def test_an_unknown_message_batch_create_field_is_refused_in_every_mode(
    client: httpx.AsyncClient, header: dict[str, str], body: dict[str, Any], field: str
) -> None:
    answer = await client.post("/anthropic/v1/messages/batches", json=body, headers=header)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"]
    assert (await client.get("/anthropic/v1/messages/batches")).json()["data"] == []


async def test_every_field_the_sdks_send_is_accepted(app: Any) -> None:
    """``client.batches.create`` with every argument the ``openai`` SDK has, and ``client.messages.batches.create``
    of the ``anthropic`` SDK (which sends ``requests`` only), create their batches; a field beyond them, sent with
    ``extra_body``, is the SDKs' 400."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    sdk = openai.AsyncOpenAI(base_url="http://miserver/v1", api_key="k", http_client=http, max_retries=0)
    uploaded = await sdk.files.create(file=("in.jsonl", LINE), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "eval"},
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert batch.status == "validating" and batch.metadata == {"team": "eval"}
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"x": 1}
        )
    assert refused.value.code == "unknown_parameter" and refused.value.param == "x"
    claude = anthropic.AsyncAnthropic(
        base_url="http://miserver/anthropic", api_key="k", http_client=http, max_retries=0
    )
    made = await claude.messages.batches.create(requests=[REQUEST])  # type: ignore[list-item]
    assert made.processing_status == "in_progress"
    with pytest.raises(anthropic.BadRequestError):
        await claude.messages.batches.create(requests=[REQUEST], extra_body={"x": 1})  # type: ignore[list-item]
    await http.aclose()
