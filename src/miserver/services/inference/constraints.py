"""The request fields that constrain sampling, checked and turned into the engine's terms: ``logit_bias``, and
``response_format`` (chat) / ``text.format`` (Responses) as a :class:`~miserver.engines.base.Grammar`.

Every check raises :class:`~miserver.errors.APIError` (400) naming the field, so a batch line with a bad value fails
alone at validation. A schema with ``strict: true`` must also follow OpenAI's strict-mode rules (:func:`strict_errors`);
without ``strict`` the schema is enforced all the same (the engine masks every token that would leave it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...engines.base import Constrains, Engine, Grammar
from ...errors import InvalidRequestError, MissingParameterError, UnknownParameterError, UnsupportedParameterError

#: OpenAI's bounds of a ``logit_bias`` value.
BIAS_LIMIT = 100.0
#: The fields of a ``json_schema`` format (chat's ``response_format.json_schema``; flat in Responses' ``text.format``
#: beside ``type``), and OpenAI's rule for its ``name``.
SCHEMA_FIELDS = ("name", "description", "schema", "strict")
FORMAT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: OpenAI's strict-mode limits: nesting depth of objects and total properties.
STRICT_MAX_DEPTH = 10
STRICT_MAX_PROPERTIES = 5000


def logit_bias_pairs(value: dict[str, float] | None, engine: Engine) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (token id as a decimal string -> bias in [-100, 100]) as (id, bias) pairs sorted by id.

    Raises :class:`InvalidRequestError` on ``logit_bias`` for a key that is not a token id of ``engine``'s model
    (``0 .. vocab_size - 1``) or a value out of range."""
    if not value:
        return ()
    vocab_size = engine.vocab_size
    pairs = []
    for key, bias in value.items():
        if not key.strip().isdigit() or int(key) >= vocab_size:
            raise InvalidRequestError(
                f"Invalid key in 'logit_bias': {key!r} is not a token id of this model (0 to {vocab_size - 1}).",
                param="logit_bias",
            )
        if not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise InvalidRequestError(
                f"Invalid value in 'logit_bias' for {key!r}: {bias} (a bias must be between -100 and 100).",
                param="logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def grammar_of(value: dict[str, Any] | None, *, param: str, flat: bool = False) -> Grammar | None:
    """The grammar a response format asks for (None for ``text`` or no format).

    ``value`` is chat's ``response_format`` (``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``), or with ``flat`` the Responses API's ``text.format`` (``{"type": "json_schema", "name", "schema",
    "strict"}``); ``param`` names it in errors. Raises :class:`InvalidRequestError` (400) for a missing name or
    schema, a name that is not 1-64 letters, digits, ``_`` or ``-``, a ``strict`` or ``description`` of the wrong
    type, a schema that is not a JSON object, or one that breaks the strict-mode rules with ``strict: true``;
    :class:`UnknownParameterError` for a field the format does not have (a misspelt one, or ``json_schema`` beside
    another type), which would otherwise be ignored.
    """
    if value is None:
        return None
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        got = "is missing" if "type" not in value else f"is {kind!r}" if isinstance(kind, str) else "is not a string"
        raise InvalidRequestError(
            f"Invalid value for '{param}.type': it {got}; it must be one of 'text', 'json_object', 'json_schema'.",
            param=f"{param}.type",
        )
    allowed: tuple[str, ...] = ("type",)
    if kind == "json_schema":
        allowed = ("type", *SCHEMA_FIELDS) if flat else ("type", "json_schema")
    _no_other_fields(value, allowed, param, kind)
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    spec = value if flat else value.get("json_schema")
    where = param if flat else f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise MissingParameterError(f"Missing required parameter: '{where}'.", param=where)
    if not flat:
        _no_other_fields(spec, SCHEMA_FIELDS, where, kind)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise MissingParameterError(f"Missing required parameter: '{where}.name'.", param=f"{where}.name")
    if not FORMAT_NAME.match(name):
        raise InvalidRequestError(
            f"Invalid '{where}.name': {name!r} must be 1-64 letters, digits, underscores or dashes.",
            param=f"{where}.name",
        )
    for field, kinds, label in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if spec.get(field) is not None and not isinstance(spec[field], kinds):
            raise InvalidRequestError(
                f"Invalid type for '{where}.{field}': expected {label}, got {type(spec[field]).__name__}.",
                param=f"{where}.{field}",
                code="invalid_type",
            )
    schema = spec.get("schema")
    if schema is None:
        raise MissingParameterError(f"Missing required parameter: '{where}.schema'.", param=f"{where}.schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"Invalid '{where}.schema': a JSON Schema is a JSON object.", param=f"{where}.schema")
    if spec.get("strict") is True:
        problem = strict_errors(schema)
        if problem is not None:
            raise InvalidRequestError(
                f"Invalid schema for response_format '{name}': {problem}", param=f"{where}.schema"
            )
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))


def _no_other_fields(value: dict[str, Any], allowed: tuple[str, ...], where: str, kind: Any) -> None:
    """Raise :class:`UnknownParameterError` naming the first field of ``value`` outside ``allowed``."""
    for key in value:
        if key not in allowed:
            hint = f" with type {kind!r}" if key in ("json_schema", *SCHEMA_FIELDS) else ""
            raise UnknownParameterError(
                f"Unknown parameter: '{where}.{key}'{hint}. Its fields are: {', '.join(allowed)}.",
                param=f"{where}.{key}",
            )


def strict_errors(schema: dict[str, Any]) -> str | None:
    """The first way ``schema`` breaks OpenAI's strict-mode rules, or None: the root is an object schema (not
    ``anyOf``); every object sets ``additionalProperties: false`` and lists each of its properties in ``required``;
    objects nest at most :data:`STRICT_MAX_DEPTH` deep and hold :data:`STRICT_MAX_PROPERTIES` properties in all."""
    if schema.get("type") != "object" or "anyOf" in schema:
        return "the root of a strict schema must be an object ('type': 'object'), not 'anyOf'."
    total = 0

    def walk(node: Any, path: str, depth: int) -> str | None:
        nonlocal total
        if isinstance(node, list):
            for i, item in enumerate(node):
                found = walk(item, f"{path}[{i}]", depth)
                if found:
                    return found
            return None
        if not isinstance(node, dict):
            return None
        kinds = node.get("type")
        is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or "properties" in node
        if is_object:
            depth += 1
            if depth > STRICT_MAX_DEPTH:
                return f"In context={path}, objects nest more than {STRICT_MAX_DEPTH} levels deep."
            if node.get("additionalProperties") is not False:
                return f"In context={path}, 'additionalProperties' is required to be supplied and to be false."
            props = node.get("properties") or {}
            total += len(props)
            if total > STRICT_MAX_PROPERTIES:
                return f"a strict schema may have at most {STRICT_MAX_PROPERTIES} properties in all."
            required = node.get("required") or []
            missing = [k for k in props if k not in required]
            if missing:
                return (
                    f"In context={path}, 'required' is required to be supplied and to be an array including every "
                    f"key in properties. Missing {missing[0]!r}."
                )
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            sub = node.get(key)
            if isinstance(sub, dict):
                for name, child in sub.items():
                    found = walk(child, f"{path}.{key}.{name}", depth)
                    if found:
                        return found
        for key in ("items", "prefixItems", "anyOf", "allOf", "oneOf", "not", "additionalProperties"):
            if key in node and node[key] is not False:
                found = walk(node[key], f"{path}.{key}", depth)
                if found:
                    return found
        return None

    return walk(schema, "()", 0)


def check_grammar(engine: Engine, grammar: Grammar | None, *, field: str, schema_param: str) -> None:
    """Compile ``grammar`` on ``engine`` now (it caches it for the run). Raises 400 ``unsupported_parameter`` on
    ``field`` (the response format) when the engine has no constrained decoding, 400 ``invalid_value`` on
    ``schema_param`` with the compiler's reason when the schema cannot be compiled."""
    if grammar is None:
        return
    if not isinstance(engine, Constrains):
        raise UnsupportedParameterError(
            f"Unsupported parameter: '{field}' of type '{grammar.kind}' is not supported by this model's engine.",
            param=field,
        )
    try:
        engine.check_grammar(grammar)
    except NotImplementedError as exc:
        raise UnsupportedParameterError(f"Unsupported parameter: '{field}': {exc}.", param=field) from exc
    except ValueError as exc:
        raise InvalidRequestError(
            f"Invalid '{schema_param}': the schema cannot be compiled: {exc}", param=schema_param
        ) from exc
