"""The error envelopes as pydantic models: what every refusal looks like on the wire (DESIGN §3).

:class:`ErrorResponse` is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (every route but
``/anthropic/``, and the body of an error line of a batch); :class:`AnthropicErrorResponse` is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (the ``/anthropic/`` routes). ``errors.APIError`` builds these
bodies; the OpenAPI document describes every error response with these models.
"""

from __future__ import annotations

from typing import Literal

from .common import ResponseModel


class ErrorObject(ResponseModel):
    """One error: a human ``message``, its ``type`` (``invalid_request_error``, ``server_error``...), the ``param``
    it names (``messages[0].content``; null when no field is to blame) and a machine ``code`` (``invalid_value``,
    ``model_not_found``...)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ResponseModel):
    """OpenAI's error envelope."""

    error: ErrorObject


class AnthropicErrorObject(ResponseModel):
    """Anthropic's error: ``type`` by HTTP status (``invalid_request_error``, ``not_found_error``...) and a message."""

    type: str
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Anthropic's error envelope."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject
