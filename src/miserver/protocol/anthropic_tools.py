"""Pydantic models of the tools of Anthropic's Messages API: ``tools`` (client tools; a server tool is refused on its
``type``) and ``tool_choice``.

Source: Anthropic's API reference (Messages, "Tool use") and the SDK's ``ToolParam`` / ``ToolChoiceParam``. The
fields of a tool that ask for what this server lacks (strict schemas, examples, deferred loading, callers, eager
input streaming) are declared so that the service refuses them by name; a tool's ``cache_control`` is accepted
without effect (:mod:`~miserver.protocol.anthropic_cache`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Discriminator, Tag
from pydantic_core import PydanticCustomError

from .anthropic_cache import CacheControl
from .common import RequestModel


class ToolParam(RequestModel):
    """A client tool: its ``name``, ``description`` and the JSON Schema of its ``input`` (an object schema).
    ``type`` is absent or ``custom``."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None
    input_examples: list[Any] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Any] | None = None
    eager_input_streaming: bool | None = None


def _refuse_server_tool(kind: str) -> str:
    raise PydanticCustomError(
        "unsupported_value",
        f"'{kind}' is a server tool, which this server does not run; only client tools (a 'name', a 'description' "
        "and an 'input_schema', 'type' absent or 'custom') are supported.",
    )


class ServerToolParam(RequestModel):
    """A tool of another ``type`` (``web_search_20250305``, ``bash_20250124``, ``text_editor_...``...), which
    Anthropic's servers run: refused on ``type``."""

    type: Annotated[str, AfterValidator(_refuse_server_tool)]


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "server" if isinstance(kind, str) and kind != "custom" else "custom"


#: One entry of ``tools``, told apart by its ``type`` so that a server tool is refused on it.
ToolUnion = Annotated[
    Annotated[ToolParam, Tag("custom")] | Annotated[ServerToolParam, Tag("server")],
    Discriminator(_tool_kind),
]


class ToolChoice(RequestModel):
    """``tool_choice``: ``auto`` (the model decides), ``any`` (it must call one of the tools), ``tool`` (it must
    call the tool ``name``) or ``none`` (it must not call one). ``disable_parallel_tool_use`` is accepted: the
    engine makes at most one call per answer whatever it says."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None
