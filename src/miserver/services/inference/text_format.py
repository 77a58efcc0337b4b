"""The Responses API's ``text.format`` (``{"type": "text" | "json_object" | "json_schema", "name", "schema",
"strict", "description"}``, flat), in the chat service's terms and as a Response echoes it."""

from __future__ import annotations

from typing import Any

from ...engines.base import Grammar
from .constraints import grammar_of

#: The fields of a ``json_schema`` format, as OpenAI names them.
SCHEMA_FIELDS = ("name", "schema", "strict", "description")


def _plain(form: dict[str, Any] | None) -> bool:
    return form is None or form.get("type") in (None, "text")


def grammar(form: dict[str, Any] | None) -> Grammar | None:
    """The grammar ``form`` asks for (None for plain text); raises 400 as
    :func:`~miserver.services.inference.constraints.grammar_of` does, naming ``text.format...``."""
    return grammar_of(form, param="text.format", flat=True)


def as_response_format(form: dict[str, Any] | None) -> dict[str, Any] | None:
    """``form`` as the chat request's ``response_format`` (None for plain text)."""
    if form is None or _plain(form):
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: form[k] for k in SCHEMA_FIELDS if k in form}}


def echo(form: dict[str, Any] | None) -> dict[str, Any]:
    """The ``text.format`` a Response echoes: the one sent (the schema as given), else plain text."""
    if form is None or _plain(form):
        return {"type": "text"}
    return {k: form[k] for k in ("type", *SCHEMA_FIELDS) if k in form}
