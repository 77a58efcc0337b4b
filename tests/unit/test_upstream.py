"""Gateway mode's pure rules (issue 12): upstream entries, the error-envelope table, Retry-After and backoff, pool
routing. The behaviour against real upstream processes is in ``tests/e2e/test_gateway.py``."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from miserver.engines.base import EngineInfo
from miserver.engines.upstream.client import ServedModel, Upstream, read_models
from miserver.engines.upstream.config import Timeouts, parse_entry, parse_upstreams
from miserver.engines.upstream.errors import normalize_error, stream_error
from miserver.engines.upstream.gateway import Gateway, KnownUpstream, OnModels
from miserver.engines.upstream.pool import UpstreamPool
from miserver.engines.upstream.retry import Answer, RetryPolicy, retry_after, send
from miserver.errors import ModelNotFoundError, UnsupportedParameterError, UpstreamUnavailableError
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference import chat, responses
from miserver.services.inference import routing as service
from miserver.services.inference.chat import parse
from miserver.services.inference.context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage


def test_entries_with_options_and_the_problems_of_bad_ones() -> None:
    a = parse_entry("gpu1=http://10.0.0.5:8001;max_in_flight=32;api_key_env=VLLM_KEY")
    assert (a.name, a.base_url, a.max_in_flight, a.api_key_env) == ("gpu1", "http://10.0.0.5:8001/v1", 32, "VLLM_KEY")
    assert a.api_key({"VLLM_KEY": "s3"}) == "s3" and a.api_key({}) is None
    assert parse_entry("b=https://h/v1/", 4).base_url == "https://h/v1"
    assert parse_entry("b=http://h", 4).max_in_flight == 4
    timed = Upstream(parse_entry("t=http://h;total_timeout=1.5"), Timeouts(first_byte=300, total=600))
    assert (timed.timeouts.total, timed.timeouts.first_byte) == (1.5, 1.5)
    configs, problems = parse_upstreams(["a=http://x:1, b=ftp://y", "c", "a=http://z:2", "d=http://w;max_in_flight=0"])
    assert [c.name for c in configs] == ["a"]
    assert len(problems) == 4
    assert "'b'" in problems[0] and "not an http(s) URL" in problems[0]
    assert "NAME=URL" in problems[1] and "more than once" in problems[2] and "max_in_flight" in problems[3]


INVALID = "invalid_request_error"
DIALECTS = [  # (engine's body, message, type, param, code)
    (
        {"error": {"message": "bad", "type": "BadRequestError", "param": "n", "code": 400}},
        "bad",
        "BadRequestError",
        "n",
        None,
    ),
    (
        {"object": "error", "message": "too long", "type": "BadRequestError", "param": None, "code": 400},
        "too long",
        "BadRequestError",
        None,
        None,
    ),
    (
        {"error": "Input validation error", "error_type": "validation"},
        "Input validation error",
        INVALID,
        None,
        "validation",
    ),
    ({"error": "model 'x' not found"}, "model 'x' not found", INVALID, None, None),
    ({"detail": [{"loc": ["body", "n"], "msg": "field required"}]}, "field required", INVALID, None, None),
]


@pytest.mark.parametrize("body, message, kind, param, code", DIALECTS)
def test_every_engine_envelope_becomes_openais(
    body: dict[str, object], message: str, kind: str, param: str | None, code: str | None
) -> None:
    error = normalize_error(400, json.dumps(body).encode(), "up")["error"]
    assert error == {"message": message, "type": kind, "param": param, "code": code}


def test_bodies_that_say_nothing_and_the_type_by_status() -> None:
    assert normalize_error(502, b"<html>Bad Gateway</html>", "up")["error"]["message"] == "<html>Bad Gateway</html>"
    silent = normalize_error(503, b"", "up")["error"]
    assert silent["message"] == "The upstream 'up' answered HTTP 503." and silent["type"] == "server_error"
    assert normalize_error(429, b"{}", "up")["error"]["type"] == "rate_limit_error"
    assert normalize_error(401, b"", "up")["error"]["type"] == "authentication_error"


def test_an_error_chunk_inside_a_stream() -> None:
    assert stream_error({"choices": [{"delta": {"content": "x"}}]}) is None
    sglang = stream_error({"object": "error", "message": "oom", "type": "InternalServerError", "code": 500})
    assert sglang is not None and sglang["error"]["message"] == "oom"
    vllm = stream_error({"error": {"message": "engine dead", "type": "EngineDeadError", "code": 500}})
    assert vllm is not None and vllm["error"]["type"] == "EngineDeadError"


def test_retry_after_and_the_backoff() -> None:
    assert retry_after(httpx.Headers({"Retry-After": "7"})) == 7.0
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < (retry_after(httpx.Headers({"Retry-After": later})) or 0) <= 30
    assert retry_after(httpx.Headers({})) is None and retry_after(httpx.Headers({"Retry-After": "soon"})) is None
    policy = RetryPolicy(max_attempts=5, base=1.0, cap=8.0)
    for attempt, top in [(0, 1.0), (1, 2.0), (3, 8.0), (9, 8.0)]:
        delays = [policy.delay(attempt, None) for _ in range(50)]
        assert all(top / 2 <= d <= top for d in delays)
    assert policy.delay(0, 20.0) == 20.0 and policy.delay(0, 3600.0) == 60.0  # Retry-After wins, capped


def test_models_listing_and_the_pool_routing() -> None:
    listed = read_models({"data": [{"id": "m", "max_model_len": 4096}, {"id": "n"}, {"id": 3}, "x"]})
    assert listed == [ServedModel("m", 4096), ServedModel("n", None)]
    a = Upstream(parse_entry("a=http://127.0.0.1:1;max_in_flight=2"), Timeouts())
    b = Upstream(parse_entry("b=http://127.0.0.1:2;max_in_flight=4"), Timeouts())
    pool = UpstreamPool("m")
    pool.join(a)
    pool.join(b)
    pool.join(a)
    assert pool.gate.slots == 6 and pool.members == [a, b]
    assert pool.pick() is None and not pool.live  # nobody answered a probe yet
    a.models, b.models = [ServedModel("m", 4096)], [ServedModel("m", 2048)]
    a.live = b.live = True
    assert pool.info.context_length == 2048 and pool.info.backend == "upstream:a,b"
    a.in_flight = 1
    assert pool.pick() is b and pool.pick(avoid=b) is a
    b.live = False
    assert pool.pick(avoid=a) is a  # the one that failed, when it is the only live member


class _Member:
    """An upstream whose HTTP answers come from an injected transport (``httpx.MockTransport``): ``state`` is
    ``up`` (lists ``m``, answers 200), ``killed`` (every request cut: the connection dropped) or ``reused`` (its port
    now hosts another server: lists only ``other`` and answers 404 to ``m``)."""

    def __init__(self, name: str) -> None:
        self.state = "up"
        self.posts: list[str] = []
        self.upstream = Upstream(parse_entry(f"{name}=http://{name}.test:1;max_in_flight=2"), Timeouts())
        transport = httpx.MockTransport(self)
        self.upstream.client = httpx.AsyncClient(base_url=f"http://{name}.test:1/v1", transport=transport)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.state == "killed":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if self.state == "killed_while_connecting":  # what anyio raises when the socket is gone as it connects
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        model = "m" if self.state == "up" else "other"
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": model, "object": "model"}]})
        self.posts.append(request.headers["x-request-id"])
        if json.loads(request.content)["model"] != model:
            error = {"message": "No model 'm'.", "type": "invalid_request_error", "code": "model_not_found"}
            return httpx.Response(404, json={"error": error})
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "model": model, "choices": []})


async def test_a_member_killed_while_its_connection_is_made_is_retried_on_the_other() -> None:
    """The transport's failure outside httpx's errors (anyio asking a socket already gone for its peer) is a connect
    error: the row goes to the live member, as for any connection refused (it failed the row before)."""
    a, b = _Member("a"), _Member("b")
    pool = UpstreamPool("m")
    for member in (a, b):
        assert await member.upstream.probe()
        pool.join(member.upstream)
    a.state = "killed_while_connecting"
    policy, deadline = RetryPolicy(max_attempts=3, base=0.001), time.monotonic() + 60
    for i in range(3):  # whichever member the pool picks first
        answer = await send(
            pool,
            "/chat/completions",
            {"model": "m"},
            request_id=f"r{i}",
            policy=policy,
            deadline=deadline,
            defer_at_deadline=False,
        )
        assert (answer.status, answer.upstream) == (200, b.upstream)
    with pytest.raises(httpx.ConnectError):
        await a.upstream.send("POST", "/chat/completions", headers={}, content=b"{}", timeout=5)


async def test_rows_to_a_killed_member_go_to_the_live_one_and_never_to_a_server_on_its_old_port() -> None:
    """A pool of two; ``a`` is SIGKILLed (its connections cut), then its port answers as another server. Every row
    is answered by ``b`` with one X-Request-Id per row; none gets the stranger's 404 as its own error."""
    a, b = _Member("a"), _Member("b")
    pool = UpstreamPool("m")
    for member in (a, b):
        assert await member.upstream.probe()
        pool.join(member.upstream)
    policy, deadline = RetryPolicy(max_attempts=3, base=0.001), time.monotonic() + 60
    a.state = "killed"
    answer = await send(
        pool,
        "/chat/completions",
        {"model": "m"},
        request_id="req_1",
        policy=policy,
        deadline=deadline,
        defer_at_deadline=False,
    )
    assert (answer.status, answer.upstream) == (200, b.upstream) and not a.upstream.live
    assert a.posts == [] and b.posts == ["req_1"]
    a.state = "reused"
    assert await a.upstream.probe() and a.upstream.live and pool.live  # it answers, as another server
    for i in range(4):
        answer = await send(
            pool,
            "/chat/completions",
            {"model": "m"},
            request_id=f"req_{i + 2}",
            policy=policy,
            deadline=deadline,
            defer_at_deadline=False,
        )
        assert (answer.status, answer.upstream) == (200, b.upstream)
    assert a.posts == []
    b.state = "killed"  # no member serves the model now: the row waits (503), it is not failed
    with pytest.raises(UpstreamUnavailableError):
        await send(
            pool,
            "/chat/completions",
            {"model": "m"},
            request_id="req_9",
            policy=policy,
            deadline=deadline,
            defer_at_deadline=False,
        )
    await asyncio.gather(a.upstream.close(), b.upstream.close())


class _Streamer:
    """An upstream that streams a chat completion and, when asked (``stream_options.include_usage``), ends with the
    usage-only chunk, as OpenAI and vLLM do; it keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m", "created": 1}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
            events.append({**chunk, "choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_stream_through_the_gateway_is_counted_whether_or_not_the_client_asks(include_usage: bool) -> None:
    """The gateway asks the upstream for the stream's usage (so that billing can count it) and keeps it in the
    stream's :class:`StreamUsage`; a client that did not ask gets no usage chunk, as from the upstream directly."""

    streamer = _Streamer()
    gw = Gateway([parse_entry("a=http://a.test:1")], Timeouts(), RetryPolicy(max_attempts=1, base=0.001))
    gw.upstreams[0].client = httpx.AsyncClient(base_url="http://a.test:1/v1", transport=httpx.MockTransport(streamer))
    await gw.refresh()
    pool = gw.pool("m")
    assert pool is not None
    ctx = ServiceContext(engine=None, gate=AdmissionGate(), gateway=gw)
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    result = await service.create(ctx, pool, "/v1/chat/completions", parse(body, strict=True), body, Call())
    assert isinstance(result, StreamResult)
    events = [json.loads(e) for e in [e async for e in result.events] if e != "[DONE]"]
    assert streamer.bodies[0]["stream_options"] == {"include_usage": True}  # always asked of the upstream
    assert [e["usage"] for e in events if "usage" in e] == (
        [{"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}] if include_usage else []
    )
    assert (result.usage.known, result.usage.prompt_tokens, result.usage.completion_tokens) == (True, 7, 2)
    await gw.upstreams[0].close()


async def _recording_gateway(bodies: list[dict[str, Any]]) -> Gateway:
    """A gateway to one upstream serving model ``m`` that answers every chat with ``"hi"`` and appends each chat body
    it receives to ``bodies``."""

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}
        return httpx.Response(200, json={**answer, "usage": usage})

    gw = Gateway([parse_entry("a=http://a.test:1")], Timeouts(), RetryPolicy(max_attempts=1, base=0.001))
    gw.upstreams[0].client = httpx.AsyncClient(base_url="http://a.test:1/v1", transport=httpx.MockTransport(upstream))
    await gw.refresh()
    return gw


async def test_fields_the_resident_engine_refuses_or_ignores_go_to_an_upstream_as_sent() -> None:
    """``verbosity`` (refused by the resident engine), ``prompt_cache_key`` and ``safety_identifier`` (accepted there
    without effect) pass the strict checks of a request for an upstream model and reach the upstream in the body,
    unchanged."""
    bodies: list[dict[str, Any]] = []
    gw = await _recording_gateway(bodies)
    resident = SimpleNamespace(info=EngineInfo("tiny", "serial", "float32", "sha256:0", 512, hidden_size=8))
    ctx = ServiceContext(engine=resident, gate=AdmissionGate(), gateway=gw)  # type: ignore[arg-type]
    fields = {"verbosity": "high", "prompt_cache_key": "tenant-7", "safety_identifier": "5f2c0e"}
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    assert isinstance(chat.check(ctx, body, strict=True)[1], UpstreamPool)  # batch validation's check passes
    on_resident = {**body, "model": "tiny"}
    with pytest.raises(UnsupportedParameterError) as refused:
        chat.check(ctx, on_resident, strict=True)
    assert refused.value.param == "verbosity"
    del on_resident["verbosity"]
    assert chat.check(ctx, on_resident, strict=True)[1] is resident  # the other two change nothing there
    result = await chat.create(ctx, body, Call(strict=True))
    assert isinstance(result, ServiceResult) and result.status_code == 200
    assert bodies == [body]
    await gw.upstreams[0].close()


async def test_a_responses_request_carries_its_end_user_and_cache_key_to_an_upstream() -> None:
    """``user``, ``safety_identifier`` and ``prompt_cache_key`` of a Responses request for an upstream model reach
    the upstream in its chat request, as sent, and the Response echoes them."""
    bodies: list[dict[str, Any]] = []
    gw = await _recording_gateway(bodies)
    ctx = ServiceContext(engine=None, gate=AdmissionGate(), gateway=gw)
    fields = {"user": "u1", "safety_identifier": "5f2c0e", "prompt_cache_key": "tenant-7"}
    body = {"model": "m", "input": "hi", "store": False, **fields}
    result = await responses.create(ctx, body, Call(strict=True))
    assert isinstance(result, ServiceResult) and result.status_code == 200
    assert len(bodies) == 1
    assert {name: bodies[0].get(name) for name in fields} == fields
    assert {name: result.body[name] for name in fields} == fields
    await gw.upstreams[0].close()


class _Listing:
    """An upstream's ``GET /v1/models`` from an injected transport: ``models`` is what it lists; None: down (every
    request's connection refused)."""

    def __init__(self, models: list[str] | None) -> None:
        self.models = models

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.models is None:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        data = [{"id": m, "max_model_len": 64} for m in self.models]
        return httpx.Response(200, json={"object": "list", "data": data})


def _gateway(
    listings: dict[str, _Listing], known: dict[str, KnownUpstream] | None = None, on_models: OnModels | None = None
) -> Gateway:
    """A gateway of one upstream per ``listings`` entry (``name=http://name.test:1``), each answering from it."""
    configs = [parse_entry(f"{n}=http://{n}.test:1") for n in listings]
    policy = RetryPolicy(max_attempts=1, base=0.001)
    gw = Gateway(configs, Timeouts(), policy, known=known, on_models=on_models)
    for upstream in gw.upstreams:
        transport = httpx.MockTransport(listings[upstream.name])
        upstream.client = httpx.AsyncClient(base_url=upstream.config.base_url, transport=transport)
    return gw


async def test_a_remembered_list_seeds_only_an_upstream_of_the_same_name_and_url() -> None:
    """Both upstreams are down at start. ``a`` is remembered at its URL: its pool exists, down (a row waits: 503,
    not 404); ``b`` is remembered at another URL: not seeded, its models unknown, so the 404 names it."""
    known = {
        "a": KnownUpstream("http://a.test:1/v1", (ServedModel("m", 4096),)),
        "b": KnownUpstream("http://old-b.test:1/v1", (ServedModel("n"),)),
    }
    gw = _gateway({"a": _Listing(None), "b": _Listing(None)}, known=known)
    await gw.refresh()
    pool = gw.pool("m")
    assert pool is not None and pool.members == gw.upstreams[:1] and not pool.live
    assert pool.info.context_length == 4096
    assert gw.pool("n") is None and gw.unknown_upstreams() == ["b"]
    with pytest.raises(UpstreamUnavailableError, match="No upstream serving 'm' is reachable now"):
        await send(
            pool,
            "/chat/completions",
            {"model": "m"},
            request_id="r",
            policy=gw.policy,
            deadline=time.monotonic() + 60,
            defer_at_deadline=False,
        )
    ctx = ServiceContext(engine=None, gate=AdmissionGate(), gateway=gw)
    with pytest.raises(ModelNotFoundError) as caught:
        ctx.resolve_model("n")
    assert caught.value.message == (
        "The model 'n' does not exist or you do not have access to it. Models served: 'm'. Upstream 'b' has not "
        "answered GET /v1/models yet; its models are not known."
    )
    await gw.close()


async def test_the_404_names_every_upstream_that_has_not_answered_and_none_once_they_have() -> None:
    listings = {"a": _Listing(None), "b": _Listing(None)}
    gw = _gateway(listings)
    ctx = ServiceContext(engine=None, gate=AdmissionGate(), gateway=gw)
    await gw.refresh()
    with pytest.raises(ModelNotFoundError) as caught:
        ctx.resolve_model("m")
    assert caught.value.message.endswith(
        "Models served: none. Upstreams 'a', 'b' have not answered GET /v1/models yet; their models are not known."
    )
    listings["a"].models, listings["b"].models = ["m"], []
    await gw.refresh()
    listings["a"].models = listings["b"].models = None  # down again: what they listed is still known
    await gw.refresh()
    assert gw.unknown_upstreams() == []
    with pytest.raises(ModelNotFoundError) as caught:
        ctx.resolve_model("x")
    assert caught.value.message == "The model 'x' does not exist or you do not have access to it. Models served: 'm'."
    await gw.close()


async def test_each_changed_list_is_handed_on_once_and_a_failed_hand_over_is_tried_again() -> None:
    handed: list[tuple[str, str, list[ServedModel]]] = []
    failing = [False]

    async def on_models(name: str, base_url: str, models: list[ServedModel]) -> None:
        if failing[0]:
            raise RuntimeError("database is down")
        handed.append((name, base_url, models))

    listing = _Listing(["m"])
    known = {"a": KnownUpstream("http://a.test:1/v1", (ServedModel("m", 64),))}
    gw = _gateway({"a": listing}, known=known, on_models=on_models)
    await gw.refresh()
    await gw.refresh()
    assert handed == [("a", "http://a.test:1/v1", [ServedModel("m", 64)])]  # the first answer, though unchanged
    listing.models = ["m", "n"]
    failing[0] = True
    await gw.refresh()
    assert len(handed) == 1 and gw.pool("n") is not None  # the pools do not wait for the hand-over
    failing[0] = False
    await gw.refresh()
    await gw.refresh()
    assert handed[1:] == [("a", "http://a.test:1/v1", [ServedModel("m", 64), ServedModel("n", 64)])]
    await gw.close()


async def test_a_seeded_model_the_upstream_no_longer_lists_takes_no_row_and_says_why() -> None:
    """``a`` was remembered serving ``m``; it comes back listing only ``n``: ``m``'s pool stays (its rows wait,
    ``upstream_unavailable``) but sends nothing to ``a``, and the 503 says that ``a`` no longer lists it."""
    listing = _Listing(None)
    gw = _gateway({"a": listing}, known={"a": KnownUpstream("http://a.test:1/v1", (ServedModel("m"),))})
    listing.models = ["n"]
    await gw.refresh()
    pool = gw.pool("m")
    assert pool is not None and not pool.live and gw.upstreams[0].live
    with pytest.raises(UpstreamUnavailableError, match="a: it no longer lists 'm' in GET /v1/models"):
        await send(
            pool,
            "/chat/completions",
            {"model": "m"},
            request_id="r",
            policy=gw.policy,
            deadline=time.monotonic() + 60,
            defer_at_deadline=False,
        )
    await gw.close()


def _stream_chunk(text: str, usage: dict[str, int] | None = None) -> str:
    chunk: dict[str, Any] = {"model": "m", "choices": [{"index": 0, "delta": {"content": text}}]}
    if usage is not None:
        chunk["usage"] = usage
    return "data: " + json.dumps(chunk)


async def _relayed(lines: list[str]) -> tuple[list[str], StreamUsage]:
    """Relay ``lines`` as an upstream's 200 stream; returns the payloads passed on and the counted usage."""
    upstream = Upstream(parse_entry("u=http://u.test:1;max_in_flight=1"), Timeouts())
    await upstream.acquire()
    pool = UpstreamPool("m")
    pool.join(upstream)
    slot = await pool.gate.acquire(Priority.INTERACTIVE)
    body = "".join(f"{x}\n\n" for x in lines).encode()
    response = httpx.Response(200, stream=httpx.ByteStream(body))
    answer = Answer(upstream, 200, b"", httpx.Headers(), response)
    counted = StreamUsage()
    relay = service._relay(answer, "m", pool, slot, counted, hide_usage=False, prompt_tokens=3)
    return [x async for x in relay], counted


async def test_a_stream_cut_before_its_usage_is_charged_the_tokens_it_delivered() -> None:
    """The upstream closes the stream after two tokens, before its usage chunk: the tokens delivered are counted
    (it charged them too), not nothing; a whole stream is counted as the upstream reports it."""
    events, counted = await _relayed([_stream_chunk("Hel"), _stream_chunk("lo")])
    assert "upstream_stream_cut" in events[-1]
    assert (counted.known, counted.prompt_tokens, counted.completion_tokens) == (True, 3, 2)
    whole = [_stream_chunk("Hi"), _stream_chunk("", usage={"prompt_tokens": 9, "completion_tokens": 5}), "data: [DONE]"]
    events, counted = await _relayed(whole)
    assert events[-1] == "[DONE]" and (counted.prompt_tokens, counted.completion_tokens) == (9, 5)
