"""Pydantic models of ``GET /v1/responses/{id}/input_items`` (OpenAI's Responses API): the items that went into a
stored Response (messages, function calls and their outputs) and the list envelope."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .common import ResponseModel


class InputItemText(ResponseModel):
    """A text part of an input item: what the user (or system, developer) said."""

    type: Literal["input_text"] = "input_text"
    text: str


class InputItemOutputText(ResponseModel):
    """A text part of an input item: an earlier answer of the model."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class StoredInputItem(ResponseModel):
    """One item that went into a Response: a message of the conversation (earlier turns included)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputItemText | InputItemOutputText]
    status: Literal["completed"] = "completed"


class StoredFunctionCall(ResponseModel):
    """A function call that went into a Response (made by an earlier Response, or sent in ``input``): ``id``
    ``fc_...``, ``arguments`` JSON text."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"] = "completed"


class StoredFunctionCallOutput(ResponseModel):
    """The result of a function call that went into a Response: ``output`` the text sent."""

    id: str
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: Literal["completed"] = "completed"


class InputItemList(ResponseModel):
    """``GET /v1/responses/{id}/input_items``: a page of input items (OpenAI's list envelope)."""

    object: Literal["list"] = "list"
    data: list[StoredInputItem | StoredFunctionCall | StoredFunctionCallOutput]
    first_id: str | None
    last_id: str | None
    has_more: bool
