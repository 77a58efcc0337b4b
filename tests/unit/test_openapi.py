"""Issue 18, item 1: ``/openapi.json`` tells the truth. Every route is documented with :func:`documented`; every
operation that reads a body has a ``requestBody``; every operation has its success response and its error responses
in the envelope of its path; the schemas are the protocol models' own (no second description)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from miserver.api.openapi import documented, operations
from miserver.app import create_app
from miserver.errors import APIError, ConflictError, EngineUnavailableError, NotFoundError, ServerError
from miserver.protocol.anthropic import MessagesRequest
from miserver.protocol.batches import Batch, BatchCreateRequest, BatchInputLine, BatchOutputLine
from miserver.protocol.chat import ChatCompletion, ChatCompletionRequest
from miserver.protocol.embeddings import EmbeddingRequest
from miserver.protocol.errors import AnthropicErrorResponse, ErrorResponse
from miserver.settings import Settings

BODY_METHODS = {"post", "put", "patch"}
#: Routes that landed before their ``@documented(...)`` line (other issues' work in progress). Each one must get its
#: decorator (README, "OpenAPI schema"); the test fails when a listed route is documented or gone, so that the list
#: only shrinks.
NOT_YET_DOCUMENTED = {
    "GET /api/account",
    "GET /api/keys",
    "GET /api/keys/{key_id}",
    "GET /api/usage",
    "GET /v1/files/{file_id}/cost_estimate",
    "POST /api/keys",
    "POST /api/keys/{key_id}/revoke",
    "POST /api/keys/{key_id}/top_up",
}


@pytest.fixture(scope="module")
def app_and_document(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("openapi")))
    return app, app.openapi()


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema["$ref"]
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]  # type: ignore[no-any-return]


def _own_schema(model: type[BaseModel], mode: str) -> dict[str, Any]:
    schema = model.model_json_schema(mode=mode, ref_template="#/components/schemas/{model}")  # type: ignore[arg-type]
    schema.pop("$defs", None)
    return schema


def test_every_route_is_documented(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    """A route without ``@documented(...)`` would be a hole in the document: add the decorator (README, "OpenAPI")."""
    app, _ = app_and_document
    names = {f"{method} {op.path}": op.documentation for op in operations(app) for method in op.methods}
    missing = sorted(name for name, doc in names.items() if doc is None and name not in NOT_YET_DOCUMENTED)
    assert not missing, f"routes without @documented(...): {missing}"
    stale = sorted(name for name in NOT_YET_DOCUMENTED if names.get(name) is not None or name not in names)
    assert not stale, f"documented or gone now, remove them from NOT_YET_DOCUMENTED: {stale}"
    assert len(names) >= 40


def test_every_operation_has_its_body_and_responses(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    app, document = app_and_document
    by_path = {(op.path, m.lower()): op.documentation for op in operations(app) for m in op.methods}
    checked = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            doc = by_path[(path, method)]
            if doc is None:
                assert f"{method.upper()} {path}" in NOT_YET_DOCUMENTED
                continue
            if doc.body is not None or doc.form is not None:
                assert method in BODY_METHODS, (method, path)
                content = operation["requestBody"]["content"]
                media = "application/json" if doc.body is not None else "multipart/form-data"
                assert list(content) == [media], (path, content)
                assert _resolve(document, content[media]["schema"])["type"] == "object"
                checked += 1
            else:
                assert "requestBody" not in operation, path
            responses = operation["responses"]
            assert "422" not in responses, path  # a bad parameter is a 400 in the error envelope here
            assert responses["200"]["content"], path
            envelope = "AnthropicErrorResponse" if path.startswith("/anthropic/") else "ErrorResponse"
            errors = [s for s in responses if s != "200"]
            assert "400" in errors and "500" in errors, (path, errors)
            for status in errors:
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": f"#/components/schemas/{envelope}"}, (path, status)
    assert checked >= 13  # every route that reads a body (chat, completions, embeddings, batches, files, ...)
    bodiless = {("post", "/v1/batches/{batch_id}/cancel"), ("post", "/api/models/unload")}
    for method, path in bodiless:
        assert "requestBody" not in document["paths"][path][method]


@pytest.mark.parametrize(
    ("model", "mode"),
    [
        (ChatCompletionRequest, "validation"),
        (EmbeddingRequest, "validation"),
        (BatchCreateRequest, "validation"),
        (MessagesRequest, "validation"),
        (BatchInputLine, "validation"),
        (ChatCompletion, "serialization"),
        (Batch, "serialization"),
        (BatchOutputLine, "serialization"),
        (ErrorResponse, "serialization"),
        (AnthropicErrorResponse, "serialization"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_schemas_are_the_protocol_models_own(
    app_and_document: tuple[Any, dict[str, Any]], model: type[BaseModel], mode: str
) -> None:
    """The document's schema of each model is the model's own JSON Schema: the same fields, the same required ones,
    the same stance on unknown fields (a nested model's name may carry its module where two modules share a name)."""
    _, document = app_and_document
    documented_schema, own = document["components"]["schemas"][model.__name__], _own_schema(model, mode)
    assert documented_schema["properties"].keys() == own["properties"].keys()
    assert documented_schema.get("required") == own.get("required")
    assert documented_schema.get("additionalProperties") == own.get("additionalProperties")
    if "$ref" not in str(own):
        assert documented_schema == own


def test_extension_fields_are_in_the_document(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    """Our extensions appear where the models have them: ``pooling`` on embeddings, ``pack`` on a batch create,
    ``millm`` on the Batch and on batch lines, the strict and lease headers."""
    _, document = app_and_document
    schemas = document["components"]["schemas"]
    assert "pooling" in schemas["EmbeddingRequest"]["properties"]
    assert "pack" in schemas["BatchCreateRequest"]["properties"]
    assert "millm" in schemas["Batch"]["properties"]
    assert "millm" in schemas["BatchOutputLine"]["properties"]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {p["name"] for p in chat["parameters"]} == {"X-miLLM-Strict", "X-miLLM-Lease"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    upload = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert upload["x-jsonl-line-schema"] == {"$ref": "#/components/schemas/BatchInputLine"}
    content = document["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert content["application/jsonl"]["x-jsonl-line-schema"] == {"$ref": "#/components/schemas/BatchOutputLine"}


@pytest.mark.parametrize(
    "error",
    [
        APIError("bad", param="messages[0].content", code="invalid_value"),
        NotFoundError("gone"),
        ConflictError("busy", code="lease_held"),
        EngineUnavailableError("no model"),
        ServerError("fault"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_error_bodies_match_the_documented_envelopes(error: APIError) -> None:
    assert ErrorResponse.model_validate(error.answer_for("/v1/chat/completions")[1]).model_dump() == error.envelope()
    status, body = error.answer_for("/anthropic/v1/messages")
    assert AnthropicErrorResponse.model_validate(body).model_dump() == body
    assert status in (error.status_code, 529)


def test_documented_refuses_an_unexplained_status() -> None:
    with pytest.raises(ValueError, match="418"):
        documented(errors=(400, 418))
