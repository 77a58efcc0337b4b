"""Anthropic's formats without a server: request checks, the chat translation, the error envelope, stop reasons,
the sampling of ``top_k``, the Message Batch object and results built from batch records and result lines, and the
store's Message Batch statements (on both databases)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miserver.batches.output import UNRUN_MESSAGES, failure_line, invalid_line, unrun_line
from miserver.batches.validate import check_line
from miserver.engines.base import EngineInfo, SamplingParams
from miserver.engines.local.generate import sample
from miserver.errors import APIError, ConflictError, EngineUnavailableError, NotFoundError, ServerError
from miserver.protocol.anthropic import CountTokensRequest, MessageBatch
from miserver.protocol.parsing import parse_request
from miserver.scheduling.admission import AdmissionGate
from miserver.services.batch_api import message_batches
from miserver.services.inference import messages, messages_chat
from miserver.services.inference.context import ServiceContext
from miserver.store import Store
from miserver.store import batches as sb
from miserver.store import message_batches as smb
from miserver.store import rows as sr
from miserver.store.batches import BatchRecord

MODEL = "tiny"
ENDPOINT = "/anthropic/v1/messages"
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "f", "description": "Weather of a city", "input_schema": OBJECT}
#: a user turn, then the assistant's call of ``f``
CALLED: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}},
        ],
    },
]
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}


@pytest.fixture
def ctx() -> ServiceContext:
    engine = SimpleNamespace(info=EngineInfo(MODEL, "serial", "float32", "sha256:0", 512))
    return ServiceContext(engine=engine, gate=AdmissionGate(1))


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}


def refusal(ctx: ServiceContext, b: Any, *, strict: bool = True) -> APIError:
    with pytest.raises(APIError) as info:
        messages.check(ctx, b, strict=strict)
    return info.value


# -- request checks ------------------------------------------------------------------------------------------------


def test_valid_bodies(ctx: ServiceContext) -> None:
    req, engine = messages.check(ctx, body(), strict=True)
    assert req.max_tokens == 5 and engine.info.model_id == MODEL
    neutral = body(
        system=[{"type": "text", "text": "Be brief."}],
        stop_sequences=["a", "b", "c", "d", "e"],
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        metadata={"user_id": "u-1"},
        tools=[],
        tool_choice={"type": "auto"},
        thinking={"type": "disabled"},
        service_tier="auto",
        stream=False,
    )
    messages.check(ctx, neutral, strict=True)


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"max_tokens": ...}, "missing_required_parameter", "max_tokens"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"temperature": 1.5}, "invalid_value", "temperature"),
        ({"top_k": -1}, "invalid_value", "top_k"),
        ({"tools": [{"name": "f"}]}, "missing_required_parameter", "tools[0].input_schema"),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "invalid_value", "tools[0].input_schema"),
        ({"tools": [{"name": "no spaces", "input_schema": OBJECT}]}, "invalid_value", "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "unsupported_value", "tools[0].type"),
        (
            {"tools": [{"name": "f", "input_schema": OBJECT, "strict": True}]},
            "unsupported_parameter",
            "tools[0].strict",
        ),
        ({"tool_choice": {"type": "any"}}, "invalid_value", "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}, "invalid_value", "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "invalid_value", "tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "invalid_value", "tool_choice.type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
            "invalid_value",
            "messages[0].content[0].tool_use_id",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "invalid_value",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [*CALLED, {"role": "user", "content": [RESULT | {"content": [{"type": "image"}]}]}]},
            "unsupported_value",
            "messages[2].content[0].content[0].type",
        ),
        (
            {"tools": [{"name": "f", "input_schema": OBJECT, "cache_control": {"type": "persistent"}}]},
            "invalid_value",
            "tools[0].cache_control",
        ),
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "invalid_value", "cache_control"),
        ({"cache_control": "ephemeral"}, "invalid_value", "cache_control"),
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"ttl": "5m"}}]},
            "invalid_value",
            "system[0].cache_control",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}}]}
                ]
            },
            "invalid_value",
            "messages[0].content[0].cache_control",
        ),
        (
            {
                "messages": [
                    *CALLED,
                    {"role": "user", "content": [RESULT | {"cache_control": {"type": "ephemeral", "x": 1}}]},
                ]
            },
            "invalid_value",
            "messages[2].content[0].cache_control",
        ),
        (
            {"system": [{"type": "text", "text": "x", "citations": []}]},
            "unsupported_parameter",
            "system[0].citations",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "unsupported_parameter", "thinking"),
        ({"service_tier": "priority"}, "unsupported_parameter", "service_tier"),
        ({"mcp_servers": [{"url": "x"}]}, "unsupported_parameter", "mcp_servers"),
        ({"messages": [{"role": "system", "content": "x"}]}, "invalid_value", "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "invalid_value",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "missing_required_parameter",
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "unsupported_value",
            "messages[1].role",
        ),
        ({"metadata": {"user_id": "u", "colour": 1}}, "unknown_parameter", "metadata.colour"),
        ({"frobnicate": 1}, "unknown_parameter", "frobnicate"),
    ],
)
def test_refusals_name_the_param(ctx: ServiceContext, extra: dict[str, Any], code: str, param: str) -> None:
    b = {k: v for k, v in body(**extra).items() if v is not ...}
    err = refusal(ctx, b)
    assert (err.status_code, err.code, err.param) == (400, code, param)
    assert param.split(".")[-1].split("[")[0] in err.message


def test_unknown_fields_only_in_strict_mode(ctx: ServiceContext) -> None:
    messages.check(ctx, body(frobnicate=1), strict=False)
    messages.check(ctx, body(metadata={"user_id": "u", "colour": 1}), strict=False)


def with_breakpoints(breakpoint: dict[str, Any] | None) -> dict[str, Any]:
    """A Messages body with ``cache_control`` set to ``breakpoint`` wherever Anthropic takes it (the request, a
    ``system`` block, a tool, a ``text``, ``tool_use`` and ``tool_result`` block, a tool result's ``text`` block);
    None: the same body without it."""
    mark = {} if breakpoint is None else {"cache_control": breakpoint}
    called = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?", **mark}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}, **mark},
            ],
        },
        {"role": "user", "content": [RESULT | {"content": [{"type": "text", "text": "18 C", **mark}]} | mark]},
    ]
    return body(system=[{"type": "text", "text": "Be brief.", **mark}], tools=[TOOL | mark], messages=called, **mark)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    "breakpoint", [{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"}, {"type": "ephemeral", "ttl": "1h"}]
)
def test_cache_control_is_accepted_without_effect(ctx: ServiceContext, strict: bool, breakpoint: Any) -> None:
    """A prompt caching breakpoint changes nothing in the answer: accepted wherever Anthropic takes it, in both
    modes, its chat request the same as without it (there is no prompt cache here)."""
    req, _ = messages.check(ctx, with_breakpoints(breakpoint), strict=strict)
    bare, _ = messages.check(ctx, with_breakpoints(None), strict=strict)
    assert messages_chat.chat_body(req) == messages_chat.chat_body(bare)
    counted = {k: v for k, v in with_breakpoints(breakpoint).items() if k != "max_tokens"}
    assert parse_request(CountTokensRequest, counted, strict=True).cache_control == breakpoint


def test_model_not_found(ctx: ServiceContext) -> None:
    err = refusal(ctx, body(model="other"))
    assert (err.status_code, err.code, err.param) == (404, "model_not_found", "model")
    assert err.anthropic_envelope()["error"]["type"] == "not_found_error"


def test_chat_body_translation(ctx: ServiceContext) -> None:
    req, _ = messages.check(
        ctx,
        body(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            temperature=0.0,
            top_p=0.5,
            top_k=7,
            stop_sequences=["x"],
        ),
        strict=True,
    )
    translated, extras = messages_chat.chat_body(req)
    assert translated == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ],
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.5,
    }
    assert (extras.stop, extras.top_k) == (("x",), 7)
    assert extras.relayed(translated) == {**translated, "stop": ["x"], "top_k": 7}


# -- the error envelope --------------------------------------------------------------------------------------------


def test_answer_for_picks_the_dialect() -> None:
    err = NotFoundError("No such thing.", param="x")
    assert err.answer_for("/v1/batches/x") == (404, err.envelope())
    assert err.answer_for("/anthropic/v1/messages") == (
        404,
        {"type": "error", "error": {"type": "not_found_error", "message": "No such thing."}},
    )
    assert EngineUnavailableError("busy").answer_for(ENDPOINT)[0] == 529
    assert EngineUnavailableError("busy").anthropic_envelope()["error"]["type"] == "overloaded_error"
    assert ServerError("x").anthropic_envelope()["error"]["type"] == "api_error"
    assert ConflictError("x").anthropic_envelope()["error"]["type"] == "invalid_request_error"


def test_batch_error_lines_carry_the_routes_body(ctx: ServiceContext) -> None:
    """A refused Messages line (at validation or while running) carries the Anthropic body the route answers."""
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": ENDPOINT, "body": body(thinking={"type": "enabled"})})
    checked = check_line(ctx, ENDPOINT, raw.encode(), set())
    assert checked.error is not None
    sync_status, sync_body = checked.error.answer_for(ENDPOINT)
    for text in (invalid_line("a", 1, checked.error, ENDPOINT), failure_line("a", checked.error, ENDPOINT)):
        out = json.loads(text)
        assert out["response"]["status_code"] == sync_status and out["response"]["body"] == sync_body
        assert out["error"] == {"code": "unsupported_parameter", "message": checked.error.message}
    openai_line = json.loads(failure_line("a", checked.error))
    assert openai_line["response"]["body"] == checked.error.envelope()


# -- top_k ---------------------------------------------------------------------------------------------------------


def test_top_k_restricts_sampling() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, -1.0, -2.0])
    params = SamplingParams(max_tokens=1, temperature=5.0, seed=0)
    drawn = {sample(logits, params, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 1, 2, 3, 4}, "without top_k every token can be drawn at a high temperature"
    top2 = dataclasses.replace(params, top_k=2)
    assert {sample(logits, top2, torch.Generator().manual_seed(s)) for s in range(200)} == {0, 1}
    top1 = dataclasses.replace(params, top_k=1)
    assert {sample(logits, top1, torch.Generator().manual_seed(s)) for s in range(20)} == {0}
    off = dataclasses.replace(params, top_k=0)
    assert sample(logits, off, torch.Generator().manual_seed(3)) == sample(
        logits, params, torch.Generator().manual_seed(3)
    )


# -- Message Batches -----------------------------------------------------------------------------------------------


def record(**fields: Any) -> BatchRecord:
    base: dict[str, Any] = {f.name: None for f in dataclasses.fields(BatchRecord)}
    base.update(
        id="batch_0123456789ab0123456789ab",
        endpoint=ENDPOINT,
        input_file_id="file-1",
        completion_window="24h",
        status="in_progress",
        created_at=1_800_000_000,
        expires_at=1_800_000_000 + 86400,
        total=0,
        completed=0,
        failed=0,
        input_tokens=0,
        output_tokens=0,
        pack=False,
    )
    base.update(fields)
    return BatchRecord(**base)


def test_ids_and_times() -> None:
    assert message_batches.message_batch_id("batch_abc") == "msgbatch_abc"
    assert message_batches.batch_id_of("msgbatch_abc") == "batch_abc"
    assert message_batches.batch_id_of("batch_abc") is None
    assert message_batches.rfc3339(0) == "1970-01-01T00:00:00Z" and message_batches.rfc3339(None) is None


def test_message_batch_object() -> None:
    validating = record(status="validating", metadata={"anthropic_requests": "7"})
    obj = MessageBatch.model_validate(message_batches.message_batch(validating, 0, "http://h/"))
    assert obj.id == "msgbatch_0123456789ab0123456789ab" and obj.processing_status == "in_progress"
    assert obj.request_counts.processing == 7 and obj.results_url is None and obj.ended_at is None
    running = record(total=7, completed=2, failed=1)
    counts = message_batches.message_batch(running, 0, "http://h/")["request_counts"]
    assert counts == {"processing": 4, "succeeded": 2, "errored": 1, "canceled": 0, "expired": 0}
    canceling = record(status="cancelling", total=7, cancelling_at=1_800_000_100)
    obj = MessageBatch.model_validate(message_batches.message_batch(canceling, 0, "http://h/"))
    assert obj.processing_status == "canceling" and obj.cancel_initiated_at == "2027-01-15T08:01:40Z"
    cancelled = record(status="cancelled", total=7, completed=2, failed=5, cancelled_at=1_800_000_200)
    obj = MessageBatch.model_validate(message_batches.message_batch(cancelled, 4, "http://h/"))
    assert obj.processing_status == "ended" and obj.ended_at == "2027-01-15T08:03:20Z"
    assert obj.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 2,
        "errored": 1,
        "canceled": 4,
        "expired": 0,
    }
    assert obj.results_url == f"http://h/anthropic/v1/messages/batches/{obj.id}/results"
    expired = record(status="expired", total=3, completed=1, failed=2, expired_at=1_800_000_300)
    assert message_batches.message_batch(expired, 2, "http://h/")["request_counts"]["expired"] == 2


def test_result_lines() -> None:
    ok = {
        "id": "batch_req_1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "r", "body": {"type": "message", "id": "msg_1"}},
        "error": None,
    }
    assert json.loads(message_batches.result_line(ok)) == {
        "custom_id": "a",
        "result": {"type": "succeeded", "message": {"type": "message", "id": "msg_1"}},
    }
    refused = json.loads(failure_line("b", NotFoundError("gone"), ENDPOINT))
    assert json.loads(message_batches.result_line(refused))["result"] == {
        "type": "errored",
        "error": {"type": "error", "error": {"type": "not_found_error", "message": "gone"}},
    }
    openai_shaped = json.loads(invalid_line(None, 4, ServerError("boom")))
    converted = json.loads(message_batches.result_line(openai_shaped))
    assert converted == {
        "custom_id": "line-4",
        "result": {"type": "errored", "error": {"type": "error", "error": {"type": "api_error", "message": "boom"}}},
    }
    assert json.loads(message_batches.result_line(json.loads(unrun_line("c", "batch_cancelled"))))["result"] == {
        "type": "canceled"
    }
    assert json.loads(message_batches.result_line(json.loads(unrun_line("d", "batch_expired"))))["result"] == {
        "type": "expired"
    }
    # a request left unrun by its batch's failure (or its key's) was not canceled by anybody: errored, with why
    for code, kind in (
        ("batch_failed", "invalid_request_error"),
        ("insufficient_quota", "billing_error"),
        ("key_revoked", "authentication_error"),
    ):
        result = json.loads(message_batches.result_line(json.loads(unrun_line("e", code))))["result"]
        assert result["type"] == "errored" and result["error"]["error"]["type"] == kind, result
        assert result["error"]["error"]["message"] == UNRUN_MESSAGES[code]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "x" * 65, "params": {}}]}, "requests[0].custom_id"),
        ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]}, "requests[1].custom_id"),
        ({"requests": [{"custom_id": "a"}]}, "requests[0].params"),
        ({}, "requests"),
    ],
)
def test_create_refusals(payload: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        message_batches.check_create(json.dumps(payload).encode())
    assert (info.value.status_code, info.value.param) == (400, param)


def test_a_message_batch_request_with_cache_control_is_accepted(ctx: ServiceContext) -> None:
    """A Message Batch's requests are checked as batch lines of ``/anthropic/v1/messages`` (strict, by the route's
    own code): a request with prompt caching breakpoints passes the create and its line's check, and a malformed
    breakpoint is its line's error, the route's 400 naming the field."""
    requests = [
        {"custom_id": "cached", "params": with_breakpoints({"type": "ephemeral", "ttl": "1h"})},
        {"custom_id": "bad", "params": body(cache_control={"type": "ephemeral", "ttl": "1d"})},
    ]
    created = message_batches.check_create(json.dumps({"requests": requests}).encode())
    lines = message_batches._lines(created)
    seen: set[str] = set()
    ok, bad = (check_line(ctx, ENDPOINT, line, seen) for line in lines)
    assert ok.error is None and ok.custom_id == "cached"
    assert bad.error is not None and (bad.error.status_code, bad.error.code, bad.error.param) == (
        400,
        "invalid_value",
        "cache_control",
    )
    assert "'cache_control'" in bad.error.anthropic_envelope()["error"]["message"]


def test_create_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(message_batches, "MAX_BATCH_BYTES", 64)
    big = json.dumps({"requests": [{"custom_id": "a", "params": {"x": "y" * 64}}]}).encode()
    with pytest.raises(APIError) as info:
        message_batches.check_create(big)
    assert info.value.status_code == 413
    assert info.value.anthropic_envelope()["error"]["type"] == "request_too_large"


# -- the store's Message Batch statements, on SQLite and PostgreSQL ---------------------------------------------------


async def test_store_listing_and_delete(store: Store) -> None:
    """Listing keeps to the endpoint, newest first, paged both ways; only an ended batch is deleted, with its rows."""
    ids = [f"batch_{i:024x}" for i in range(1, 6)]
    async with store.tx() as conn:
        for i, batch_id in enumerate(ids):
            endpoint = "/v1/chat/completions" if i == 2 else ENDPOINT
            await sb.insert_batch(
                conn,
                batch_id=batch_id,
                endpoint=endpoint,
                input_file_id="file-1",
                completion_window="24h",
                created_at=1,
                expires_at=86401,
                metadata=None,
                pack=False,
                output_expires_seconds=None,
            )
            await sr.insert_rows(conn, batch_id, [{"line": 1, "custom_id": "a", "valid": True, "body": "{}"}])
        await sb.set_fields(conn, ids[0], ("validating",), total=1)
        await sb.transition(conn, ids[0], ("validating",), "failed", 2)
    mine = [ids[4], ids[3], ids[1], ids[0]]  # newest first, without the chat batch
    async with store.tx() as conn:
        page, more = await smb.list_for_endpoint(conn, endpoint=ENDPOINT, limit=2, after=None, before=None)
        assert ([b.id for b in page], more) == (mine[:2], True)
        page, more = await smb.list_for_endpoint(conn, endpoint=ENDPOINT, limit=2, after=mine[1], before=None)
        assert ([b.id for b in page], more) == (mine[2:], False)
        page, more = await smb.list_for_endpoint(conn, endpoint=ENDPOINT, limit=1, after=None, before=mine[2])
        assert ([b.id for b in page], more) == ([mine[1]], True)
        page, more = await smb.list_for_endpoint(conn, endpoint=ENDPOINT, limit=5, after=None, before=mine[2])
        assert ([b.id for b in page], more) == (mine[:2], False)
        assert not await smb.delete_ended(conn, ids[1]), "a batch still validating is not deleted"
        assert await smb.delete_ended(conn, ids[0])
        assert await sb.get_batch(conn, ids[0]) is None and await sb.get_batch(conn, ids[1]) is not None
        assert [r async for r in sr.iter_rows(conn, ids[0])] == []
        assert len([r async for r in sr.iter_rows(conn, ids[1])]) == 1
