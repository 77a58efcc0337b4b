"""Issue 10 §1, §4, §5, §6: text that is valid JSON but not Unicode, fields accepted and then ignored, error params.

Every synchronous case is checked through the endpoint service's own ``check`` (what the route calls) and its batch
twin through ``check_line`` (what batch validation calls, strict). No model is loaded: the engine is a stand-in
that only names the served model.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from types import SimpleNamespace, UnionType
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

from miserver import protocol
from miserver.batches.validate import check_line
from miserver.engines.base import EngineInfo
from miserver.errors import APIError
from miserver.protocol.batches import BatchCreateRequest
from miserver.protocol.chat import ChatCompletionRequest
from miserver.protocol.common import RequestModel
from miserver.protocol.completions import CompletionRequest
from miserver.protocol.embeddings import EmbeddingRequest
from miserver.protocol.parsing import parse_request
from miserver.protocol.probes import ProbeCreateRequest, ProbeScoreRequest
from miserver.protocol.validation_errors import describe
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference.checks import decode_json
from miserver.services.inference.context import ServiceContext
from miserver.services.inference.registry import SERVICES

MODEL = "tiny"
CHAT, TEXT, EMB, PROBE = "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/probes/score"
USER = [{"role": "user", "content": "hi"}]
#: A minimal valid body per endpoint.
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": USER},
    TEXT: {"model": MODEL, "prompt": "hi"},
    EMB: {"model": MODEL, "input": "hi"},
    PROBE: {"probe": "p", "input": "hi"},
}
#: The request model of each endpoint (and of the other JSON routes that share ``parse_request``).
MODELS: dict[str, type[BaseModel]] = {
    CHAT: ChatCompletionRequest,
    TEXT: CompletionRequest,
    EMB: EmbeddingRequest,
    PROBE: ProbeScoreRequest,
    "/api/probes": ProbeCreateRequest,
    "/v1/batches": BatchCreateRequest,
}
SUR = "\ud800"  # an unpaired (high) surrogate: what json.loads makes of the escape "\ud800"


@pytest.fixture
def ctx() -> ServiceContext:
    engine = SimpleNamespace(info=EngineInfo(MODEL, "serial", "float32", "sha256:0", 512, hidden_size=8))
    return ServiceContext(engine=engine, gate=AdmissionGate(1))  # type: ignore[arg-type]


def sync_error(ctx: ServiceContext, endpoint: str, body: Any, *, strict: bool = False) -> APIError | None:
    """What the synchronous route answers (its service's ``check``), or None when the body passes."""
    try:
        SERVICES[endpoint].check(ctx, body, strict=strict)
    except APIError as exc:
        return exc
    return None


def raw_line(body: Any, endpoint: str = CHAT, **line: Any) -> bytes:
    """A batch input line, written with ``ensure_ascii`` so that a surrogate travels as its JSON escape."""
    obj = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body, **line}
    return json.dumps(obj).encode("ascii")


def line_error(ctx: ServiceContext, endpoint: str, body: Any, **line: Any) -> tuple[str | None, APIError | None]:
    cid, _, _, err = check_line(ctx, endpoint, raw_line(body, endpoint, **line), set())
    return cid, err


def in_line(param: str, endpoint: str = CHAT) -> str:
    """How a batch line's validation error names a body field: OpenAI's Batch API form ``body.<param>``, but for
    Anthropic's Message Batches (their errors name no line field)."""
    return param if endpoint == "/anthropic/v1/messages" else f"body.{param}"


def assert_encodable(err: APIError) -> None:
    """The error reaches a response, a log line and the database: it must encode as UTF-8."""
    json.dumps(err.envelope(), ensure_ascii=False).encode("utf-8")
    json.dumps(err.as_batch_error(1), ensure_ascii=False).encode("utf-8")


# -- §1 unpaired surrogates ----------------------------------------------------------------------------------------

SURROGATE_CASES = [
    (CHAT, {"messages": [{"role": "user", "content": f"hi {SUR}"}]}, "messages[0].content"),
    (
        CHAT,
        {"messages": [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": SUR}]},
        "messages[2].content",
    ),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b\udc00"}]}
            ]
        },
        "messages[0].content[1].text",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": SUR}]}, "messages[0].name"),
    (CHAT, {"model": f"tiny{SUR}"}, "model"),
    (CHAT, {"user": SUR}, "user"),
    (CHAT, {"stop": SUR}, "stop"),
    (CHAT, {"stop": ["a", f"x{SUR}"]}, "stop[1]"),
    (CHAT, {"metadata": {"k": SUR}}, "metadata.k"),
    (CHAT, {"metadata": {f"k{SUR}": "v"}}, "metadata.k\\ud800"),
    (CHAT, {"response_format": {"type": SUR}}, "response_format.type"),
    (TEXT, {"prompt": f"Once {SUR}"}, "prompt"),
    (TEXT, {"prompt": ["ok", SUR]}, "prompt[1]"),
    (TEXT, {"stop": SUR}, "stop"),
    (TEXT, {"suffix": SUR}, "suffix"),
    (TEXT, {"user": SUR}, "user"),
    (EMB, {"input": SUR}, "input"),
    (EMB, {"input": ["a", "b", f"c{SUR}"]}, "input[2]"),
    (EMB, {"user": SUR}, "user"),
    (EMB, {"model": SUR}, "model"),
    (PROBE, {"probe": SUR}, "probe"),
    (PROBE, {"input": ["a", SUR]}, "input[1]"),
    (PROBE, {"user": SUR}, "user"),
]


@pytest.mark.parametrize(("endpoint", "change", "param"), SURROGATE_CASES)
@pytest.mark.parametrize("strict", [False, True])
def test_unpaired_surrogate_is_refused_naming_the_field(
    ctx: ServiceContext, endpoint: str, change: dict[str, Any], param: str, strict: bool
) -> None:
    body = {**BASE[endpoint], **change}
    err = sync_error(ctx, endpoint, body, strict=strict)
    assert err is not None and (err.status_code, err.code, err.param) == (400, "invalid_value", param)
    assert "unpaired surrogate" in err.message and f"'{param}'" in err.message
    assert_encodable(err)
    # the batch twin: the same error, and the line keeps its custom_id
    cid, line_err = line_error(ctx, endpoint, body)
    assert cid == "a" and line_err is not None
    # the param in OpenAI's Batch API form (body.<field>), but for Anthropic's Message Batches
    assert (line_err.code, line_err.param, line_err.message) == (err.code, in_line(param, endpoint), err.message)


def test_an_unknown_field_with_a_surrogate_is_refused_even_when_unknown_fields_are_ignored(ctx: ServiceContext) -> None:
    err = sync_error(ctx, CHAT, {**BASE[CHAT], "extra": {"deep": [SUR]}}, strict=False)
    assert err is not None and (err.code, err.param) == ("invalid_value", "extra.deep[0]")
    err = sync_error(ctx, CHAT, {**BASE[CHAT], f"x{SUR}": 1}, strict=False)
    assert err is not None and err.param == "x\\ud800"
    assert_encodable(err)


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ProbeCreateRequest, {"name": "p", "layer": 1, "texts": ["a", f"b{SUR}"], "labels": [0, 1]}, "texts[1]"),
        (ProbeCreateRequest, {"name": "p", "layer": 1, "description": SUR}, "description"),
        (ProbeCreateRequest, {"name": "p", "layer": 1, "labels": ["x", SUR]}, "labels[1]"),
        (
            BatchCreateRequest,
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": SUR}},
            "metadata.k",
        ),
        (
            BatchCreateRequest,
            {"input_file_id": f"file-{SUR}", "endpoint": CHAT, "completion_window": "24h"},
            "input_file_id",
        ),
    ],
)
def test_other_json_routes_refuse_surrogates(model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    """Probe create and batch create go through ``parse_request`` too."""
    with pytest.raises(APIError) as info:
        parse_request(model, body, strict=False)  # type: ignore[type-var]
    assert (info.value.code, info.value.param) == ("invalid_value", param)


def test_every_json_body_is_checked_where_it_is_decoded() -> None:
    """``decode_json`` (every route's body: leases, model loading...) refuses before any route reads the body."""
    with pytest.raises(APIError) as info:
        decode_json(b'{"holder": "me \\ud800", "ttl_seconds": 60}')
    assert (info.value.code, info.value.param) == ("invalid_value", "holder")
    assert "\\ud800" in info.value.message
    assert_encodable(info.value)
    # a surrogate pair is one character, and valid
    assert decode_json(b'{"holder": "\\ud83d\\ude00"}') == {"holder": "\U0001f600"}


def test_json_nested_past_the_parser_limit_is_a_400_not_a_crash(ctx: ServiceContext) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(APIError) as info:
        decode_json(deep.encode())
    assert (info.value.status_code, info.value.code) == (400, "invalid_json")
    raw = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": ' + deep + "}").encode()
    _, _, _, err = check_line(ctx, CHAT, raw, set())
    assert err is not None and err.code == "invalid_json_line"


def test_a_surrogate_deep_inside_is_found_without_recursion() -> None:
    with pytest.raises(APIError) as info:
        decode_json(("[" * 900 + '"\\ud800"' + "]" * 900).encode())
    assert info.value.param == "[0]" * 900


def test_a_custom_id_with_a_surrogate_fails_its_line_alone(ctx: ServiceContext) -> None:
    raw = raw_line(BASE[CHAT], custom_id="sur\udc00id")
    assert b"\\udc00" in raw  # the file itself is valid UTF-8
    cid, body, model, err = check_line(ctx, CHAT, raw, set())
    assert err is not None and (err.code, err.param) == ("invalid_value", "custom_id")
    assert cid is None and body is None and model is None  # nothing unencodable goes to the error file
    assert_encodable(err)
    # the lines around it are valid
    seen: set[str] = set()
    assert check_line(ctx, CHAT, raw_line(BASE[CHAT], custom_id="r1"), seen)[3] is None
    assert check_line(ctx, CHAT, raw, seen)[3] is not None
    assert check_line(ctx, CHAT, raw_line(BASE[CHAT], custom_id="r3"), seen)[3] is None


@pytest.mark.parametrize(
    ("line", "param"),
    [({"method": f"POST{SUR}"}, "method"), ({"url": f"/v1/chat{SUR}"}, "url"), ({f"x{SUR}": 1}, "x\\ud800")],
)
def test_other_line_fields_with_a_surrogate(ctx: ServiceContext, line: dict[str, Any], param: str) -> None:
    cid, err = line_error(ctx, CHAT, BASE[CHAT], **line)
    assert err is not None and (err.code, err.param) == ("invalid_value", param)
    assert cid == "a"
    assert_encodable(err)


# -- §4 fields accepted and then ignored ----------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_message_name_is_refused(ctx: ServiceContext, strict: bool) -> None:
    body = {"model": MODEL, "messages": [*USER, {"role": "user", "content": "x", "name": "Alice"}]}
    err = sync_error(ctx, CHAT, body, strict=strict)
    assert err is not None and (err.code, err.param) == ("unsupported_parameter", "messages[1].name")
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and (line_err.code, line_err.param) == (
        "unsupported_parameter",
        in_line("messages[1].name"),
    )
    # a null name is no name
    assert sync_error(ctx, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": None}]}) is None


@pytest.mark.parametrize(
    ("endpoint", "change", "param"),
    [
        (CHAT, {"store": True}, "store"),
        (CHAT, {"service_tier": "flex"}, "service_tier"),
        (CHAT, {"service_tier": "priority"}, "service_tier"),
        (CHAT, {"verbosity": "low"}, "verbosity"),
        (CHAT, {"verbosity": "medium"}, "verbosity"),  # OpenAI's default, yet no setting the resident model has
    ],
)
def test_fields_that_ask_for_what_the_server_does_not_do_are_refused(
    ctx: ServiceContext, endpoint: str, change: dict[str, Any], param: str
) -> None:
    body = {**BASE[endpoint], **change}
    err = sync_error(ctx, endpoint, body)
    assert err is not None and (err.code, err.param) == ("unsupported_parameter", param)
    _, line_err = line_error(ctx, endpoint, body)
    assert line_err is not None and (line_err.code, line_err.param) == (
        "unsupported_parameter",
        in_line(param, endpoint),
    )


@pytest.mark.parametrize(
    ("endpoint", "change"),
    [
        (CHAT, {"store": False}),
        (CHAT, {"service_tier": "auto"}),
        (CHAT, {"service_tier": "default"}),
        (CHAT, {"user": "u1", "metadata": {"k": "v"}}),
        (CHAT, {"safety_identifier": "5f2c0e", "user": "u1"}),
        (CHAT, {"prompt_cache_key": "tenant-7"}),
        (CHAT, {"verbosity": None, "prompt_cache_key": None}),
        (CHAT, {"parallel_tool_calls": True, "tool_choice": "none"}),
        (CHAT, {"response_format": {"type": "text"}}),
        (TEXT, {"user": "u1"}),
        (EMB, {"user": "u1"}),
        (PROBE, {"user": "u1"}),
    ],
)
def test_fields_that_change_nothing_are_accepted(ctx: ServiceContext, endpoint: str, change: dict[str, Any]) -> None:
    body = {**BASE[endpoint], **change}
    assert sync_error(ctx, endpoint, body, strict=True) is None
    assert line_error(ctx, endpoint, body)[1] is None


@pytest.mark.parametrize("strict", [False, True])
def test_a_prompt_cache_key_is_accepted_as_user_and_safety_identifier_are(ctx: ServiceContext, strict: bool) -> None:
    """``prompt_cache_key`` is a hint for a provider's prompt cache that changes nothing in the output, as OpenAI
    defines it: chat accepts it in both modes and in a batch line, as the Responses API does."""
    body = {**BASE[CHAT], "prompt_cache_key": "tenant-7", "safety_identifier": "5f2c0e", "user": "u1"}
    assert sync_error(ctx, CHAT, body, strict=strict) is None
    assert line_error(ctx, CHAT, body)[1] is None


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"safety_identifier": 5}, "invalid_type", "safety_identifier"),
        ({"prompt_cache_key": ["a"]}, "invalid_type", "prompt_cache_key"),
        ({"prompt_cache_key": 7}, "invalid_type", "prompt_cache_key"),
        ({"verbosity": 1}, "invalid_value", "verbosity"),
        ({"verbosity": "terse"}, "invalid_value", "verbosity"),
    ],
)
def test_newer_openai_fields_of_the_wrong_type_are_named(
    ctx: ServiceContext, change: dict[str, Any], code: str, param: str
) -> None:
    """``safety_identifier``, ``prompt_cache_key`` and ``verbosity`` are declared: a bad value is a 400 naming the
    field in both modes and in a batch line, never an unknown field ignored or a refusal of a field nobody sent."""
    body = {**BASE[CHAT], **change}
    for strict in (False, True):
        err = sync_error(ctx, CHAT, body, strict=strict)
        assert err is not None and (err.code, err.param) == (code, param), err
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and (line_err.code, line_err.param) == (code, in_line(param))
    assert line_err.message == err.message


def test_max_tokens_and_max_completion_tokens_that_differ_are_refused(ctx: ServiceContext) -> None:
    body = {**BASE[CHAT], "max_tokens": 5, "max_completion_tokens": 7}
    err = sync_error(ctx, CHAT, body)
    assert err is not None and (err.code, err.param) == ("invalid_value", "max_tokens")
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and line_err.param == in_line("max_tokens")
    assert sync_error(ctx, CHAT, {**body, "max_completion_tokens": 5}) is None


def test_stream_options_without_stream_is_refused_on_text_completions_too(ctx: ServiceContext) -> None:
    body = {**BASE[TEXT], "stream_options": {"include_usage": True}}
    err = sync_error(ctx, TEXT, body)
    assert err is not None and (err.code, err.param) == ("invalid_value", "stream_options")
    assert sync_error(ctx, TEXT, {**body, "stream": True}) is None


# -- §5 error messages and params --------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image content"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio content"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file content"),
    ],
)
def test_image_part_is_refused_on_its_type(ctx: ServiceContext, part: dict[str, Any], words: str, strict: bool) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}],
    }
    err = sync_error(ctx, CHAT, body, strict=strict)
    assert err is not None and (err.status_code, err.code, err.param) == (
        400,
        "unsupported_value",
        "messages[0].content[1].type",
    )
    assert words in err.message and "not supported by this model" in err.message
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and err.param is not None
    assert (line_err.code, line_err.param, line_err.message) == (err.code, in_line(err.param), err.message)


@pytest.mark.parametrize(
    ("part", "code", "param"),
    [
        ({"type": "bogus", "text": "x"}, "invalid_value", "messages[0].content[0].type"),
        ({"text": "x"}, "missing_required_parameter", "messages[0].content[0].type"),
        ({"type": "text"}, "missing_required_parameter", "messages[0].content[0].text"),
        ({"type": "text", "text": 5}, "invalid_type", "messages[0].content[0].text"),
        ({"type": ["text"], "text": "x"}, "invalid_type", "messages[0].content[0].type"),
        ({"type": {"a": 1}, "text": "x"}, "invalid_type", "messages[0].content[0].type"),
        ({"type": None, "text": "x"}, "invalid_type", "messages[0].content[0].type"),
        ("just a string", "invalid_type", "messages[0].content[0]"),
    ],
)
def test_content_part_errors_name_the_part_field(ctx: ServiceContext, part: Any, code: str, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    err = sync_error(ctx, CHAT, body)
    assert err is not None and (err.code, err.param) == (code, param)
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and (line_err.code, line_err.param) == (code, in_line(param))


@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
def test_stop_of_the_wrong_type_names_stop_and_what_it_accepts(ctx: ServiceContext, endpoint: str) -> None:
    body = {**BASE[endpoint], "stop": 5}
    err = sync_error(ctx, endpoint, body)
    assert err is not None and (err.code, err.param) == ("invalid_type", "stop")
    assert "'stop'" in err.message and "a string or a list of up to 4 strings" in err.message
    _, line_err = line_error(ctx, endpoint, body)
    assert line_err is not None and (line_err.param, line_err.message) == (in_line("stop", endpoint), err.message)
    too_many = sync_error(ctx, endpoint, {**BASE[endpoint], "stop": ["a", "b", "c", "d", "e"]})
    assert too_many is not None and (too_many.code, too_many.param) == ("invalid_value", "stop")
    one_bad = sync_error(ctx, endpoint, {**BASE[endpoint], "stop": ["a", 5]})
    assert one_bad is not None and (one_bad.code, one_bad.param) == ("invalid_type", "stop[1]")


@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
@pytest.mark.parametrize(("stop", "param"), [("", "stop"), (["a", ""], "stop[1]")])
def test_an_empty_stop_sequence_is_refused_not_dropped(
    ctx: ServiceContext, endpoint: str, stop: Any, param: str
) -> None:
    body = {**BASE[endpoint], "stop": stop}
    err = sync_error(ctx, endpoint, body)
    assert err is not None and (err.code, err.param) == ("invalid_value", param)
    _, line_err = line_error(ctx, endpoint, body)
    assert line_err is not None and (line_err.code, line_err.param, line_err.message) == (
        err.code,
        in_line(param, endpoint),
        err.message,
    )


@pytest.mark.parametrize("value", [{}, {"type": "bogus"}, {"type": 5}, {"json_schema": {}}])
def test_response_format_of_no_known_type_is_an_invalid_value(ctx: ServiceContext, value: Any) -> None:
    body = {**BASE[CHAT], "response_format": value}
    err = sync_error(ctx, CHAT, body)
    assert err is not None and (err.code, err.param) == ("invalid_value", "response_format.type")
    _, line_err = line_error(ctx, CHAT, body)
    assert line_err is not None and (line_err.code, line_err.param) == (
        "invalid_value",
        in_line("response_format.type"),
    )


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_response_format_on_an_engine_without_constrained_decoding_is_unsupported(
    ctx: ServiceContext, kind: str
) -> None:
    spec = {"json_schema": {"name": "x", "schema": {"type": "object"}}} if kind == "json_schema" else {}
    err = sync_error(ctx, CHAT, {**BASE[CHAT], "response_format": {"type": kind, **spec}})
    assert err is not None and (err.code, err.param) == ("unsupported_parameter", "response_format")


# -- §5 no param carries an internal type name: a walk over every union-typed field --------------------------------


def _strip(annotation: Any) -> Any:
    while getattr(annotation, "__metadata__", None) is not None:
        annotation = get_args(annotation)[0]
    return annotation


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _is_union(annotation: Any) -> bool:
    annotation = _strip(annotation)
    members = [a for a in get_args(annotation) if a is not type(None)]
    return get_origin(annotation) in (Union, UnionType) and len(members) > 1


def union_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every union-typed field reachable from ``model`` (``stop``, ``messages[0].content``...), as a path."""
    found: list[str] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        annotation = info.annotation
        if _is_union(annotation):
            found.append(path)
        inner = _strip(annotation)
        for sub in _models_in(annotation):
            item = get_origin(inner) is list or any(get_origin(_strip(a)) is list for a in get_args(inner))
            found.extend(union_fields(sub, f"{path}[0]" if item else path))
        for arg in get_args(inner):  # list[Annotated[union, ...]]: the items are a union too
            if get_origin(_strip(arg)) is list and _is_union(get_args(_strip(arg))[0]):
                found.append(f"{path}[0]")
    return found


def all_field_names(model: type[BaseModel]) -> set[str]:
    names = set(model.model_fields)
    for info in model.model_fields.values():
        for sub in _models_in(info.annotation):
            names |= all_field_names(sub)
    return names


def all_class_names(model: type[BaseModel]) -> set[str]:
    names = {model.__name__}
    for info in model.model_fields.values():
        for sub in _models_in(info.annotation):
            names |= all_class_names(sub)
    return names


def set_path(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    parts = [p for p in re.split(r"\.|\[(\d+)\]", path) if p]
    node: Any = body
    for part, following in zip(parts, parts[1:]):
        key: Any = int(part) if part.isdigit() else part
        want = list if following.isdigit() else dict
        if isinstance(node, list):
            while len(node) <= key:
                node.append({})
        if isinstance(node, dict) and key not in node or not isinstance(node[key], want):
            node[key] = [{}] if want is list else {}
        node = node[key]
    last = parts[-1]
    node[int(last) if last.isdigit() else last] = value
    return body


#: Values of the wrong type (or shape) for any union field.
WRONG = [
    5,
    1.5,
    True,
    {},
    {"a": 1},
    {"type": ["x"]},
    {"type": 5},
    [{"type": {}}],
    [{}],
    [[{}]],
    [1, "a"],
    ["a", 1],
    [[1], "a"],
    [None],
    [[1, "x"]],
    "text",
    [],
]
PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*$")
#: How pydantic names union members and validators in an error's location.
INTERNAL = ("str]", "list[", "int]", "tagged-union", "function-", "[key]", "union[")
BODIES = {
    **BASE,
    "/api/probes": {"name": "p", "layer": 1},
    "/v1/batches": {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"},
}


def test_the_walk_finds_the_union_fields() -> None:
    assert set(union_fields(ChatCompletionRequest)) >= {"stop", "messages[0].content", "messages[0].content[0]"}
    assert set(union_fields(CompletionRequest)) >= {"stop", "prompt"}
    assert "input" in union_fields(EmbeddingRequest) and "input" in union_fields(ProbeScoreRequest)
    assert {"weights", "bias", "classes", "labels"} <= set(union_fields(ProbeCreateRequest))


@pytest.mark.parametrize(("endpoint", "path"), [(e, p) for e, m in MODELS.items() for p in union_fields(m)])
def test_no_param_carries_an_internal_type_name(ctx: ServiceContext, endpoint: str, path: str) -> None:
    model = MODELS[endpoint]
    names = all_field_names(model)
    for value in WRONG:
        body = set_path(BODIES[endpoint], path, value)
        try:
            parse_request(model, body, strict=True)  # type: ignore[type-var]
            continue  # a value the field accepts (an empty list, a string...)
        except APIError as exc:
            err = exc
        assert err.param is not None and PATH.match(err.param), (path, value, err.param)
        assert all(p in names for p in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", err.param)), (path, value, err.param)
        leaked = [n for n in (*INTERNAL, *all_class_names(model)) if n in err.message]
        assert not leaked, (path, value, err.message)
        if endpoint in SERVICES:  # the synchronous route and the batch line say the same
            sync = sync_error(ctx, endpoint, body, strict=True)
            _, line = line_error(ctx, endpoint, body)
            assert sync is not None and line is not None
            assert (sync.param, sync.message) == (err.param, err.message)
            assert (line.param, line.message) == (in_line(err.param, endpoint), err.message)


def test_describe_says_what_a_field_accepts() -> None:
    fields = CompletionRequest.model_fields
    assert describe(fields["stop"].annotation) == "a string or a list of up to 4 strings"
    assert describe(fields["prompt"].annotation) == (
        "a string, a list of strings, a list of integers or a list of lists of integers"
    )
    assert describe(ChatCompletionRequest.model_fields["messages"].annotation) == "a list of objects"


# -- non-finite numbers: NaN, Infinity, -Infinity (what Python's JSON reader makes of those literals, and of 1e999) ---


def request_models() -> list[type[BaseModel]]:
    """Every request model of the protocol layer (each module's subclasses of ``RequestModel``)."""
    found: set[type[BaseModel]] = set()
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"{protocol.__name__}.{info.name}")
        found |= {c for _, c in inspect.getmembers(module, inspect.isclass) if issubclass(c, RequestModel)}
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def holding(annotation: Any, number: float) -> tuple[Any, str] | None:
    """A JSON value of ``annotation``'s shape with ``number`` where a float goes, and the path to it from the
    field (``""``, ``"[0]"``, ``".k"``); None when the annotation holds no float."""
    annotation = _strip(annotation)
    if annotation is float:
        return number, ""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        return next((found for a in args if (found := holding(a, number)) is not None), None)
    if origin is list and (found := holding(args[0], number)) is not None:
        return [found[0]], f"[0]{found[1]}"
    if origin is dict and (found := holding(args[1], number)) is not None:
        return {"k": found[0]}, f".k{found[1]}"
    return None


FLOAT_FIELDS = [
    (model, name) for model in request_models() for name, f in model.model_fields.items() if holding(f.annotation, 0.0)
]


def test_the_walk_finds_the_float_fields() -> None:
    names = {(m.__name__, n) for m, n in FLOAT_FIELDS}
    assert {("ChatCompletionRequest", "temperature"), ("ChatCompletionRequest", "logit_bias")} <= names
    assert {("MessagesRequest", "top_p"), ("ResponseCreateRequest", "temperature")} <= names
    assert {("LeaseRequest", "ttl_seconds"), ("RenewRequest", "ttl_seconds")} <= names
    assert {("ProbeCreateRequest", "weights"), ("ProbeCreateRequest", "bias"), ("ProbeCreateRequest", "C")} <= names


@pytest.mark.parametrize(("model", "name"), FLOAT_FIELDS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_every_float_field_of_every_request_model_refuses_a_non_finite_number(
    model: type[BaseModel], name: str, number: float
) -> None:
    """The field's own error says "finite number", and no bound (``<= 2``) is reported about a value that is no
    number at all."""
    found = holding(model.model_fields[name].annotation, number)
    assert found is not None
    with pytest.raises(ValidationError) as caught:
        model.model_validate({name: found[0]})
    own = [e for e in caught.value.errors() if e["loc"][:1] == (name,)]
    assert any(e["type"] == "finite_number" for e in own), own
    assert not [e for e in own if e["type"] in ("less_than_equal", "greater_than_equal", "less_than", "greater_than")]


@pytest.mark.parametrize(("endpoint", "name"), [(e, n) for e, m in MODELS.items() for mm, n in FLOAT_FIELDS if mm is m])
def test_a_non_finite_number_is_named_with_its_path_on_the_route_and_in_a_batch_line(
    ctx: ServiceContext, endpoint: str, name: str
) -> None:
    found = holding(MODELS[endpoint].model_fields[name].annotation, float("nan"))
    assert found is not None
    body = {**BODIES[endpoint], name: found[0]}
    param = name + found[1]
    err = None
    try:
        parse_request(MODELS[endpoint], body, strict=True)  # type: ignore[type-var]
    except APIError as exc:
        err = exc
    assert err is not None and (err.code, err.param) == ("invalid_value", param)
    assert err.message == f"Invalid value for '{param}': Input should be a finite number."
    if endpoint in SERVICES:
        sync = sync_error(ctx, endpoint, body, strict=True)
        _, line = line_error(ctx, endpoint, body)
        assert sync is not None and line is not None
        assert (sync.param, sync.message) == (err.param, err.message)
        assert (line.param, line.message) == (in_line(param, endpoint), err.message)
