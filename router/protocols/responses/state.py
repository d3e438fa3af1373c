"""A stateful Responses request: the conversation it continues, its input items as stored (with
ids), and the input_items list's pages. Pure (pydantic + stdlib).

With `previous_response_id`, a request's input is the stored conversation (every earlier input
item, then the earlier response's output items: messages, reasoning items and function calls) and
then its own input. `instructions` are not carried over (OpenAI's rule): each request gives its
own. Neither are tools, text format or sampling settings."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from router.protocols.openai import ProtocolError
from router.protocols.responses.requests import InputItem, ResponsesRequest
from router.protocols.responses.store import StoredResponse

_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}


def stored_item(item: InputItem) -> dict[str, Any]:
    """An input item as the input_items list returns it: the client's id or a new one, a status,
    the fields of its type (OpenAI's shapes: ResponseInputMessageItem, ResponseOutputMessage,
    ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem, ResponseReasoningItem)."""
    out: dict[str, Any] = {"id": item.id or f"{_PREFIX[item.type]}_{uuid.uuid4().hex}", "type": item.type}
    parts = [p.model_dump(exclude_none=True) for p in item.content or ()]
    if item.type == "message":
        if item.role == "assistant":  # ResponseOutputMessage's parts: output_text (with annotations) or refusal
            parts = [p if p["type"] == "refusal" else {"type": "output_text", "text": p.get("text", ""), "annotations": []} for p in parts]
        out |= {"role": item.role, "content": parts, "status": "completed"}
    elif item.type == "function_call":
        out |= {"call_id": item.call_id, "name": item.name, "arguments": item.arguments, "status": "completed"}
        if item.namespace is not None:
            out["namespace"] = item.namespace
    elif item.type == "custom_tool_call":
        out |= {"call_id": item.call_id, "name": item.name, "input": item.input, "status": "completed"}
    elif item.type in ("function_call_output", "custom_tool_call_output"):
        output = [p.model_dump(exclude_none=True) for p in item.output or ()]
        text_only = len(output) == 1 and output[0]["type"] == "input_text"
        out |= {"call_id": item.call_id, "output": output[0]["text"] if text_only else output, "status": "completed"}
    else:  # reasoning
        out |= {"summary": [], "content": parts}
    return out


def conversation(previous: StoredResponse | None, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items of `req` as stored: the previous response's conversation, then its own."""
    return [*(previous.conversation() if previous is not None else ()), *(stored_item(i) for i in req.input)]


def continued(req: ResponsesRequest, previous: StoredResponse | None) -> ResponsesRequest:
    """`req` with the previous response's conversation before its own input (the stored items
    validated again as input items: an output item is one). An input item whose id is already in
    that conversation is a 400, as OpenAI's: sent again, it would be in the prompt twice."""
    if previous is None:
        return req
    stored = previous.conversation()
    ids = {item.get("id") for item in stored}
    for j, item in enumerate(req.input):
        if item.id is not None and item.id in ids:
            raise ProtocolError(
                400, "invalid_value", f"Duplicate item found with id {item.id}: it is in the previous response's conversation already.", f"input[{j}]"
            )
    earlier = [InputItem.model_validate(item) for item in stored]
    return req.model_copy(update={"input": [*earlier, *req.input]})


def item_page(items: list[dict[str, Any]], *, limit: int = 20, order: Literal["asc", "desc"] = "desc", after: str | None = None) -> dict[str, Any]:
    """One page of a response's input items, OpenAI's list shape (data, first_id, last_id, has_more),
    newest first unless `order` is asc; `after` an item id of the list (a 400 if it is not one)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ProtocolError(400, "invalid_value", f"no input item '{after}' in this response", "after")
        start = ids.index(after) + 1
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }
