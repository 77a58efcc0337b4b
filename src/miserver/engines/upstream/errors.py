"""What an upstream's answers mean to miServer: which failures are retried, and the error-envelope table that turns
the envelopes of vLLM, SGLang, TGI, llama.cpp and Ollama into OpenAI's ``{"error": {message, type, param, code}}``.

| engine | its error body | read as |
|---|---|---|
| OpenAI, vLLM >= 0.6, llama.cpp | ``{"error": {"message", "type", "param", "code"}}`` | kept; numeric code: null |
| vLLM (older), SGLang | ``{"object": "error", "message", "type", "param", "code"}`` | the same fields |
| TGI | ``{"error": "text", "error_type": "validation"}`` | message; ``code`` the ``error_type`` |
| Ollama | ``{"error": "text"}`` | message |
| FastAPI-style servers | ``{"detail": "text" or [...]}`` | message (a list is joined) |
| anything else | any other body, or none | message: the start of the body, or the status |

Where the body names no ``type``, it follows the status: 401 ``authentication_error``, 403 ``permission_error``,
429 ``rate_limit_error``, another 4xx ``invalid_request_error``, 5xx ``server_error``.
"""

from __future__ import annotations

import json
from typing import Any

#: Statuses retried (another attempt, after a backoff, on another upstream of the pool when there is one).
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Characters of a non-JSON error body kept in the message.
MAX_TEXT = 500


def default_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status, when the upstream names none."""
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def _text(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value:  # FastAPI's validation detail: [{"loc", "msg", ...}]
        return "; ".join(str(v.get("msg", v)) if isinstance(v, dict) else str(v) for v in value)
    return None


def normalize_error(status: int, content: bytes, upstream: str) -> dict[str, Any]:
    """The OpenAI error envelope of an upstream's error answer (status ``status``, body ``content``).

    ``upstream`` (its name) goes into the message when the body says nothing usable. Never raises.
    """
    try:
        body: Any = json.loads(content) if content else None
    except (ValueError, UnicodeDecodeError):
        body = None
    message: str | None = None
    kind: str | None = None
    param: Any = None
    code: Any = None
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):  # OpenAI, vLLM >= 0.6, llama.cpp
            message, kind, param, code = (
                _text(inner.get("message")),
                inner.get("type"),
                inner.get("param"),
                inner.get("code"),
            )
        elif body.get("object") == "error" or ("message" in body and inner is None):  # SGLang, older vLLM
            message, kind, param, code = (
                _text(body.get("message")),
                body.get("type"),
                body.get("param"),
                body.get("code"),
            )
        elif isinstance(inner, str):  # TGI (error_type), Ollama
            message, code = _text(inner), body.get("error_type")
        elif "detail" in body:  # FastAPI
            message = _text(body.get("detail"))
    if message is None:
        text = content.decode("utf-8", errors="replace").strip()[:MAX_TEXT] if content and body is None else ""
        message = text or f"The upstream '{upstream}' answered HTTP {status}."
    return {
        "error": {
            "message": message,
            "type": kind if isinstance(kind, str) and kind else default_type(status),
            "param": param if isinstance(param, str) else None,
            "code": code if isinstance(code, str) and code else None,
        }
    }


def stream_error(payload: Any) -> dict[str, Any] | None:
    """The OpenAI error envelope when a Server-Sent Events payload (one decoded ``data:`` JSON value) is an error
    chunk rather than a chunk of the answer (vLLM and SGLang send ``{"error": {...}}`` or ``{"object": "error"}``
    inside a 200 stream); None for an ordinary chunk."""
    if not isinstance(payload, dict):
        return None
    if "error" in payload or payload.get("object") == "error":
        inner = payload.get("error")
        codes = [payload.get("code"), inner.get("code") if isinstance(inner, dict) else None]
        status = next((c for c in codes if isinstance(c, int) and 400 <= c <= 599), 500)
        return normalize_error(status, json.dumps(payload).encode(), "")
    return None
