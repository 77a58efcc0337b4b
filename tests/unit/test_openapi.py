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
from miserver.services.accounts.scopes import ROUTE_SCOPES
from miserver.settings import Settings

BODY_METHODS = {"post", "put", "patch"}


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
    """A route without ``@documented(...)`` would be a hole in the document: add the decorator (docs/openapi.md)."""
    app, _ = app_and_document
    names = {f"{method} {op.path}": op.documentation for op in operations(app) for method in op.methods}
    missing = sorted(name for name, doc in names.items() if doc is None)
    assert not missing, f"routes without @documented(...): {missing}"
    assert len(names) >= 40


def test_every_operation_has_its_body_and_responses(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    app, document = app_and_document
    by_path = {(op.path, m.lower()): op.documentation for op in operations(app) for m in op.methods}
    checked = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            doc = by_path[(path, method)]
            assert doc is not None, (method, path)
            if doc.body is not None or doc.form is not None:
                assert method in BODY_METHODS, (method, path)
                content = operation["requestBody"]["content"]
                media = "application/json" if doc.body is not None else "multipart/form-data"
                assert list(content) == [media], (path, content)
                assert _resolve(document, content[media]["schema"])["type"] == "object"
                if doc.body is not None:  # a JSON body past its limit is refused before it is read whole
                    assert "413" in operation["responses"], (method, path)
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
    assert checked >= 15  # every route that reads a body (chat, completions, embeddings, batches, files, ...)
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
    assert {p["name"] for p in chat["parameters"]} == {"X-miLLM-Strict", "X-miLLM-Lease", "X-miLLM-Batch-Invariant"}
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


def test_auth_errors_follow_the_route(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    """401 on every route but the liveness probe; 403 exactly on the admin-only ones (``require_admin``, on the
    route or its router) and on those that need a scope a key may lack; 402 on the inference routes."""
    _, document = app_and_document
    paths = document["paths"]
    admin_only = {
        ("post", "/api/keys"),
        ("get", "/api/keys"),
        ("get", "/api/keys/{key_id}"),
        ("post", "/api/keys/{key_id}/revoke"),
        ("post", "/api/keys/{key_id}/top_up"),
    }
    scoped = {(m.lower(), p) for m, p in ROUTE_SCOPES}
    with_403 = {(m, p) for p, item in paths.items() for m, op in item.items() if "403" in op["responses"]}
    assert with_403 == admin_only | scoped, sorted(with_403 ^ (admin_only | scoped))
    assert ("post", "/api/models/load") in with_403 and ("get", "/api/health/detailed") not in with_403
    assert "401" not in paths["/api/health"]["get"]["responses"]
    assert "401" in paths["/api/account"]["get"]["responses"]
    assert "402" in paths["/v1/chat/completions"]["post"]["responses"]
    assert "402" not in paths["/api/usage"]["get"]["responses"]


def test_accounts_answers_are_their_models(app_and_document: tuple[Any, dict[str, Any]]) -> None:
    """The accounts routes' bodies and answers are the models of ``protocol/accounts.py`` (the key create body is
    refused beyond its fields: the route parses it strictly)."""
    _, document = app_and_document
    paths, schemas = document["paths"], document["components"]["schemas"]

    def answer(method: str, path: str) -> Any:
        return paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"]

    create = paths["/api/keys"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert _resolve(document, create)["additionalProperties"] is False
    assert answer("post", "/api/keys") == {"$ref": "#/components/schemas/KeyObject"}
    assert answer("get", "/api/keys") == {"$ref": "#/components/schemas/KeyList"}
    assert answer("get", "/api/usage") == {"$ref": "#/components/schemas/UsageRollup"}
    assert answer("get", "/v1/files/{file_id}/cost_estimate") == {"$ref": "#/components/schemas/CostEstimate"}
    refs = {branch["$ref"] for branch in schemas["Account"]["anyOf"]}
    assert refs == {"#/components/schemas/KeyObject", "#/components/schemas/AnonymousAccount"}
    assert "key" not in schemas["KeyObject"].get("required", [])
