"""SDK conformance: every route driven by ``openai.AsyncOpenAI(_strict_response_validation=True)``, and the batch
object checked against the SDK's types at every status a batch passes through (validating, in_progress,
finalizing, completed, failed, cancelling, cancelled, expired).

The application runs in-process over ASGI (the SDK's own HTTP client with an ASGI transport), so the clock can be
moved for expiry and the runner can be held at ``finalizing``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletionMessageParam

from miserver.app import create_app
from miserver.settings import Settings
from tests.support.inprocess import Clock, hold_finishing, installed_clock, set_weights_torn


@pytest.fixture
async def sdk(
    tiny_model_dir: Path, database_url: str, tmp_path: Path
) -> AsyncIterator[tuple[openai.AsyncOpenAI, Clock]]:
    settings = Settings(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        database_url=database_url,
        data_dir=tmp_path / "var",
        batch_poll_seconds=0.05,
    )
    app = create_app(settings)
    with installed_clock() as clock:
        async with app.router.lifespan_context(app):
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://miserver/v1")
            client = openai.AsyncOpenAI(
                base_url="http://miserver/v1",
                api_key="test",
                http_client=http,
                _strict_response_validation=True,
                max_retries=0,
            )
            async with client:
                yield client, clock


def rows(n: int, **body: Any) -> bytes:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2, **body},
        }
        for i in range(n)
    ]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def until(client: openai.AsyncOpenAI, batch_id: str, status: str, reason: str | None = None) -> Batch:
    for _ in range(1200):
        b = await client.batches.retrieve(batch_id)
        if b.status == status and (reason is None or (b.model_extra or {})["millm"]["waiting_reason"] == reason):
            return b
        await asyncio.sleep(0.05)
    raise AssertionError(f"{batch_id} never reached {status}/{reason}: {b}")


async def test_every_route_and_every_status_parses_strictly(
    sdk: tuple[openai.AsyncOpenAI, Clock], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, clock = sdk
    seen: dict[str, Batch] = {}

    # models and inference
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(model="tiny", messages=hi, max_tokens=3, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None
    text = await client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, logprobs=2)
    assert text.usage is not None and text.usage.completion_tokens <= 3
    stream = await client.chat.completions.create(
        model="tiny", messages=hi, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None

    # files
    f = await client.files.create(file=("in.jsonl", rows(3)), purpose="batch")
    assert isinstance(f, FileObject) and f.purpose == "batch" and f.status == "processed"
    assert (await client.files.retrieve(f.id)).bytes == len(rows(3))
    page = await client.files.list(limit=1)
    assert page.data[0].id == f.id
    assert (await client.files.content(f.id)).content == rows(3)

    # validating -> in_progress (held by the weights-torn flag) -> finalizing (held) -> completed
    await set_weights_torn(database_url, True)
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
    )
    seen[b.status] = b
    seen["in_progress"] = await until(client, b.id, "in_progress", "weights_torn")
    release = hold_finishing(monkeypatch)
    await set_weights_torn(database_url, False)
    seen["finalizing"] = await until(client, b.id, "finalizing")
    release.set()
    seen["completed"] = await until(client, b.id, "completed")
    out = await client.files.content(seen["completed"].output_file_id)  # type: ignore[arg-type]
    assert [json.loads(x)["custom_id"] for x in out.text.splitlines()] == ["r0", "r1", "r2"]

    # failed
    empty = await client.files.create(file=("empty.jsonl", b""), purpose="batch")
    failed = await client.batches.create(
        input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    seen["failed"] = await until(client, failed.id, "failed")

    # cancelling -> cancelled (a batch held by the flag cannot finish before the cancel)
    await set_weights_torn(database_url, True)
    g = await client.files.create(file=("in.jsonl", rows(4)), purpose="batch")
    c = await client.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="2h")
    await until(client, c.id, "in_progress", "weights_torn")
    seen["cancelling"] = await client.batches.cancel(c.id)
    seen["cancelled"] = await until(client, c.id, "cancelled")

    # expired
    e = await client.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="1h")
    await until(client, e.id, "in_progress", "weights_torn")
    clock.offset = 3600
    seen["expired"] = await until(client, e.id, "expired")
    await set_weights_torn(database_url, False)

    assert set(seen) == {
        "validating",
        "in_progress",
        "finalizing",
        "completed",
        "failed",
        "cancelling",
        "cancelled",
        "expired",
    }
    for status, batch in seen.items():
        assert isinstance(batch, Batch) and batch.status == status
        assert batch.request_counts is not None and batch.usage is not None
        if status in ("completed", "failed", "cancelled", "expired"):
            counts = batch.request_counts
            assert counts.completed + counts.failed == counts.total, (status, counts)
    assert seen["completed"].metadata == {"k": "v"}
    assert seen["completed"].usage is not None and seen["completed"].usage.output_tokens > 0
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(seen["completed"], stamp) is not None
    assert seen["cancelled"].cancelling_at is not None and seen["cancelled"].cancelled_at is not None
    assert seen["expired"].expired_at is not None

    listed = await client.batches.list(limit=2)
    assert len(listed.data) == 2 and listed.has_more
    everything = [x.id async for x in client.batches.list(limit=2)]  # the SDK follows `after` across pages
    assert len(everything) == len(set(everything)) == 4

    deleted = await client.files.delete(empty.id)
    assert deleted.deleted and deleted.id == empty.id
    assert (await client.batches.retrieve(failed.id)).status == "failed"  # a batch outlives its files


async def test_cancel_during_finalizing_backlog_and_queued_batches(
    sdk: tuple[openai.AsyncOpenAI, Clock], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = sdk
    http = client._client  # the SDK's own HTTP client, for the miServer routes
    await set_weights_torn(database_url, True)
    f = await client.files.create(file=("in.jsonl", rows(5)), purpose="batch")
    first = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await until(client, first.id, "in_progress", "weights_torn")
    health = (await http.get("http://miserver/api/health/detailed")).json()
    assert health["inference"]["batch_backlog_rows"] == 5
    assert health["inference"]["slots"] == {"total": 24, "in_use": 0}  # MISERVER_MAX_SEQUENCES
    assert health["model"]["id"] == "tiny"

    # a second batch shares the engine with the first (batches take turns chunk by chunk, issue 14): while the first
    # is held in finalizing, the second runs all its rows (its own finish is held too)
    second = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    release = hold_finishing(monkeypatch)
    await set_weights_torn(database_url, False)
    await until(client, first.id, "finalizing")
    for _ in range(1200):
        running = await client.batches.retrieve(second.id)
        if running.request_counts is not None and running.request_counts.completed == 5:
            break
        await asyncio.sleep(0.05)
    assert running.status == "in_progress" and running.request_counts is not None, running
    assert running.request_counts.completed == 5, running

    # cancel while finalizing: the batch ends cancelled, never completed, and keeps every recorded row
    cancelling = await client.batches.cancel(first.id)
    assert cancelling.status == "cancelling"
    release.set()
    cancelled = await until(client, first.id, "cancelled")
    assert cancelled.completed_at is None and cancelled.finalizing_at is not None
    assert cancelled.request_counts is not None and cancelled.request_counts.completed == 5
    out = await client.files.content(cancelled.output_file_id)  # type: ignore[arg-type]
    assert len(out.text.splitlines()) == 5
    refused = await http.post(f"http://miserver/v1/batches/{cancelled.id}/cancel")
    assert refused.status_code == 200 and refused.json()["status"] == "cancelled"  # cancelled again: unchanged
    done = await until(client, second.id, "completed")
    errors = (await client.files.content(done.error_file_id)).text[:2000] if done.error_file_id else ""
    assert done.request_counts is not None and done.request_counts.completed == 5, errors
    completed_cancel = await http.post(f"http://miserver/v1/batches/{done.id}/cancel")
    assert completed_cancel.status_code == 409
    assert (await client.batches.retrieve(done.id)).status == "completed"
