"""Upstream configuration (DESIGN §8): ``NAME=URL`` entries with optional per-upstream options, and the timeouts.

An entry is ``name=url`` optionally followed by ``;option=value`` pairs::

    vllm-a=http://10.0.0.5:8000;max_in_flight=32;api_key_env=VLLM_A_KEY;total_timeout=120

``url`` is the server's base URL, with or without the trailing ``/v1``. ``api_key_env`` names the environment
variable that holds the API key sent as ``Authorization: Bearer`` (a key is never written on the command line).
``total_timeout`` (seconds) replaces ``MISERVER_UPSTREAM_TOTAL_TIMEOUT`` for this upstream.
Several entries are separated by commas (``MISERVER_UPSTREAMS``) or given as repeated ``--upstream`` options.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

#: In-flight requests per upstream when an entry does not say.
DEFAULT_MAX_IN_FLIGHT = 16
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class UpstreamConfigError(ValueError):
    """A malformed upstream entry; the message names the entry and what is wrong with it."""


@dataclass(frozen=True)
class UpstreamConfig:
    """One upstream: ``name`` (in ``X-miLLM-Backend: upstream:<name>``), ``base_url`` (ending in ``/v1``),
    ``max_in_flight`` (requests sent to it at once, at least 1), ``api_key_env`` (None: no key) and
    ``total_timeout`` (seconds of one attempt; None: the server-wide setting)."""

    name: str
    base_url: str
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    api_key_env: str | None = None
    total_timeout: float | None = None

    def api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The API key read from ``api_key_env`` now (None when no variable is named or it is unset or empty)."""
        if self.api_key_env is None:
            return None
        return (environ if environ is not None else os.environ).get(self.api_key_env) or None


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed to one attempt: ``connect`` (TCP connect), ``first_byte`` (request sent until the response
    headers: a non-streamed answer comes whole, so this bounds generation too), ``idle`` (between two reads of the
    body), ``total`` (the whole attempt). A synchronous request's attempts all end within ``total`` of its start."""

    connect: float = 5.0
    first_byte: float = 300.0
    idle: float = 60.0
    total: float = 600.0


def parse_entry(entry: str, default_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> UpstreamConfig:
    """One ``name=url[;option=value...]`` entry. Raises :class:`UpstreamConfigError` naming the entry."""
    head, *options = [part.strip() for part in entry.strip().split(";")]
    name, sep, url = head.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not NAME.match(name):
        raise UpstreamConfigError(
            f"upstream {entry!r}: expected NAME=URL with NAME of letters, digits, '-', '_' or '.' (e.g. "
            "vllm=http://127.0.0.1:8001)"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UpstreamConfigError(f"upstream {name!r}: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8001)")
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    max_in_flight, key_env, total = default_max_in_flight, None, None
    for option in options:
        key, sep, value = (x.strip() for x in option.partition("="))
        if key == "max_in_flight" and sep and value.isdigit() and int(value) >= 1:
            max_in_flight = int(value)
        elif key == "api_key_env" and sep and value:
            key_env = value
        elif key == "total_timeout" and sep and _positive(value):
            total = float(value)
        else:
            raise UpstreamConfigError(
                f"upstream {name!r}: unknown or invalid option {option!r} (options: max_in_flight=N with N >= 1, "
                "api_key_env=VARIABLE, total_timeout=SECONDS)"
            )
    return UpstreamConfig(name, base, max_in_flight, key_env, total)


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def parse_upstreams(
    entries: Iterable[str], default_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
) -> tuple[list[UpstreamConfig], list[str]]:
    """``(configs, problems)`` of ``entries`` (each a single entry or several separated by commas; blanks skipped).

    A malformed entry, or a name given a second time, is left out and described by one line in ``problems`` (the
    server warns and starts without it: a bad upstream never stops the server).
    """
    configs: list[UpstreamConfig] = []
    problems: list[str] = []
    for text in entries:
        for entry in text.split(","):
            if not entry.strip():
                continue
            try:
                config = parse_entry(entry, default_max_in_flight)
            except UpstreamConfigError as exc:
                problems.append(str(exc))
                continue
            if any(c.name == config.name for c in configs):
                problems.append(f"upstream {config.name!r} is given more than once ({entry.strip()!r})")
                continue
            configs.append(config)
    return configs, problems
