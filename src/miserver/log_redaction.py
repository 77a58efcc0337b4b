"""Credentials kept out of every log line: API keys (``sk-...``), webhook signing secrets (``whsec_...``), bearer
tokens, console session cookies and the values of query parameters whose name ends like a credential's (``api_key``,
``key``, ``token``, ``access_token``, ``secret``, ``password``, ``session``, ``signature``...) become ``***``.

:class:`RedactingFilter` rewrites a record before any handler formats it: the message, its arguments (uvicorn's
access log line formats the request target from them), and the traceback text. :func:`install` puts it on the root
logger's handlers; :func:`uvicorn_log_config` is uvicorn's own logging configuration with the filter on its
handlers (the access log and the error log).
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

#: Shown in place of a credential.
MASK = "***"

_CREDENTIAL_NAME = (
    r"[\w.\-\[\]]*?(?:key|token|secret|passw(?:or)?d|pwd|session(?:_?id)?|auth(?:orization)?|cookie|signature|sig"
    r"|credentials?)"
)
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # a query parameter (or form field) named like a credential: its value, whatever it looks like
    (re.compile(rf"(?i)((?:^|[?&;\s\"'])(?:{_CREDENTIAL_NAME})=)[^&;\s\"'#]*"), rf"\1{MASK}"),
    # the console's cookies: miserver_console=<session id>, miserver_console_signin=<csrf token>
    (re.compile(r"(miserver_console(?:_signin)?=)[^;\s\"',&]*"), rf"\1{MASK}"),
    # an Authorization header's credential
    (re.compile(r"(?i)\b(bearer)(\s+)[^\s\"',;]+"), rf"\1\2{MASK}"),
    # anything shaped like a miServer (or OpenAI) key or a webhook signing secret, wherever it stands
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}"), f"sk-{MASK}"),
    (re.compile(r"\bwhsec_[A-Za-z0-9+/=_\-]{6,}"), f"whsec_{MASK}"),
)


def redact(text: str) -> str:
    """``text`` with every credential in it replaced by :data:`MASK`."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _redacted_arg(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, (int, float)) or value is None:
        return value
    text = str(value)
    cleaned = redact(text)
    return value if cleaned == text else cleaned


class RedactingFilter(logging.Filter):
    """Rewrites each record it sees so that no credential reaches the output; never drops one."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted_arg(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {name: _redacted_arg(arg) for name, arg in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Put a :class:`RedactingFilter` on every handler of ``logger`` (the root logger by default) lacking one."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's default logging configuration with a :class:`RedactingFilter` on each of its handlers."""
    from uvicorn.config import LOGGING_CONFIG

    config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact"] = {"()": f"{__name__}.RedactingFilter"}
    for handler in config["handlers"].values():
        handler["filters"] = [*handler.get("filters", []), "redact"]
    return config
