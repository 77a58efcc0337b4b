"""The exception tree of miServer and its one mapping to the OpenAI error envelope.

Every refusal, from a route or from a batch row, is an :class:`APIError`. Its :meth:`APIError.envelope` is the body
``{"error": {"message", "type", "param", "code"}}`` that OpenAI returns, and :attr:`APIError.status_code` is the HTTP
status. A batch error line carries exactly the same status and body as the synchronous route would. The routes under
``/anthropic/`` answer in Anthropic's envelope instead: :meth:`APIError.answer_for` picks the dialect by route.
"""

from __future__ import annotations

from typing import Any

#: Routes under this prefix answer in Anthropic's error envelope (DESIGN §10).
ANTHROPIC_PREFIX = "/anthropic/"
#: Anthropic's error ``type`` by HTTP status (its API reference, "Errors").
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """A client-visible error: HTTP status plus the OpenAI envelope fields."""

    status_code: int = 400
    type: str = "invalid_request_error"
    default_code: str | None = None
    #: Seconds to wait before retrying, sent as ``Retry-After`` (None: no header).
    retry_after: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def envelope(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_status(self) -> int:
        """The HTTP status on the ``/anthropic`` routes: the same, but 529 (``overloaded_error``) for a 503."""
        return 529 if self.status_code == 503 else self.status_code

    def anthropic_envelope(self) -> dict[str, Any]:
        """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``, its type by status
        (:data:`ANTHROPIC_ERROR_TYPES`; another 4xx is ``invalid_request_error``, another 5xx ``api_error``)."""
        status = self.anthropic_status()
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def answer_for(self, path: str) -> tuple[int, dict[str, Any]]:
        """``(status, body)`` of this error on the route ``path`` (a batch line: its endpoint): Anthropic's status and
        envelope under ``/anthropic/``, OpenAI's elsewhere. The one place that picks an error's dialect."""
        if path.startswith(ANTHROPIC_PREFIX):
            return self.anthropic_status(), self.anthropic_envelope()
        return self.status_code, self.envelope()

    def as_batch_error(self, line: int | None = None) -> dict[str, Any]:
        """The ``batch.errors.data`` entry: ``{code, message, param, line}``."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": line}


class InvalidRequestError(APIError):
    """400: the request is malformed or names a bad value."""

    default_code = "invalid_value"


class MissingParameterError(InvalidRequestError):
    """400: a required field is absent."""

    default_code = "missing_required_parameter"


class UnknownParameterError(InvalidRequestError):
    """400: a field the endpoint does not know (strict mode)."""

    default_code = "unknown_parameter"


class UnsupportedParameterError(InvalidRequestError):
    """400: a known field that this engine cannot honour (tools, logit_bias...); never silently ignored."""

    default_code = "unsupported_parameter"


class UnsupportedValueError(InvalidRequestError):
    """400: a value this engine cannot honour in a field it knows (an image content part for a text-only model)."""

    default_code = "unsupported_value"


class ContextLengthError(InvalidRequestError):
    """400: the prompt plus ``max_tokens`` does not fit the model's context."""

    default_code = "context_length_exceeded"


class NotFoundError(APIError):
    """404: an object (file, batch) that does not exist."""

    status_code = 404
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    """404 ``model_not_found``: the request names a model this server does not serve."""

    default_code = "model_not_found"


class FileExpiredError(NotFoundError):
    """404 ``file_expired``: the file's record stays, its content is gone."""

    default_code = "file_expired"


class ConflictError(APIError):
    """409: the object is in a state that forbids the operation."""

    status_code = 409
    default_code = "conflict"


class PayloadTooLargeError(APIError):
    """413: an upload beyond a limit of DESIGN §6; the message names the limit and the measured value."""

    status_code = 413
    default_code = "file_too_large"


#: The message of every 500, on the synchronous routes and in batch error files alike (OpenAI's wording).
SERVER_ERROR_MESSAGE = "The server had an error while processing your request."


class ServerError(APIError):
    """500: a real fault of the server (never a client's mistake)."""

    status_code = 500
    type = "server_error"
    default_code = "internal_error"


class EngineUnavailableError(APIError):
    """503: the engine cannot take the request now (model not resident, shutting down)."""

    status_code = 503
    type = "server_error"
    default_code = "engine_unavailable"


class AuthenticationError(APIError):
    """401 ``invalid_api_key``: the request carries no API key, or one this server does not know (or revoked)."""

    status_code = 401
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    """403 ``permission_denied``: the key is valid but the route is for admin keys only."""

    status_code = 403
    default_code = "permission_denied"


class InsufficientQuotaError(APIError):
    """402 ``insufficient_quota``: the key's balance is used up (402, not 429: the SDKs retry a 429)."""

    status_code = 402
    type = "insufficient_quota"
    default_code = "insufficient_quota"


class QueueQuotaError(APIError):
    """429: creating the batch would exceed one of the key's queue quotas; the message names the limit and the
    current value (``code``: ``pending_batch_limit_exceeded`` or ``token_limit_exceeded``)."""

    status_code = 429
    type = "tokens"
    default_code = "token_limit_exceeded"


class UpstreamUnavailableError(EngineUnavailableError):
    """503 ``upstream_unavailable``: no upstream serving the model is reachable now (gateway mode); a batch row is
    not failed for it: it waits with ``waiting_reason: upstream_unavailable``."""

    default_code = "upstream_unavailable"
    retry_after = 5  # the default health probe period (MISERVER_UPSTREAM_HEALTH_SECONDS): when it is looked at again


class UpstreamTimeoutError(APIError):
    """504 ``upstream_timeout``: the upstream did not answer within the configured timeouts."""

    status_code = 504
    type = "server_error"
    default_code = "upstream_timeout"


class UpstreamError(APIError):
    """An upstream's own error answer, kept with its status (a 4xx that is the request's own fault, or the last
    retryable answer); ``envelope`` is OpenAI's, normalised from the upstream's dialect."""

    def __init__(self, status_code: int, envelope: dict[str, Any]) -> None:
        error = envelope["error"]
        super().__init__(str(error["message"]), param=error.get("param"), code=error.get("code"))
        self.status_code = status_code
        self.type = str(error.get("type") or "server_error")
