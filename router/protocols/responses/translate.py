"""A Responses request -> an OpenAI chat-completions body: instructions and input items as chat
messages, flat tools as chat tools, text.format as response_format."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from router.protocols.responses.requests import ContentPart, ResponsesRequest


def _image(part: ContentPart) -> dict[str, Any]:
    url: dict[str, Any] = {"url": part.image_url}
    if part.detail in ("auto", "low", "high"):
        url["detail"] = part.detail
    return {"type": "image_url", "image_url": url}


def _parts(parts: Iterable[ContentPart]) -> list[dict[str, Any]]:
    return [_image(p) if p.type == "input_image" else {"type": "text", "text": p.as_text()} for p in parts]


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A lone text part as a plain string (what every chat template takes), else the parts."""
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


_ROLE = {"developer": "system"}


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as OpenAI chat messages. Consecutive function_call items join the
    assistant message before them (one turn, several tool_calls); a function_call_output becomes a
    role "tool" message, and its images a user message after the turn's tool messages (chat tool
    messages carry text only). Reasoning items are dropped: open-model chat templates strip past
    reasoning themselves, and Orchard's reasoning items carry no encrypted state to restore."""
    out: list[dict[str, Any]] = []
    if req.instructions is not None:
        out.append({"role": "system", "content": req.instructions})
    names: dict[str, str] = {}
    pending_images: list[dict[str, Any]] = []

    def flush_images() -> None:
        if pending_images:
            out.append({"role": "user", "content": list(pending_images)})
            pending_images.clear()

    for item in req.input:
        if item.type != "function_call_output":
            flush_images()
        if item.type == "message":
            assert item.role is not None
            out.append({"role": _ROLE.get(item.role, item.role), "content": _content(_parts(item.content or ()))})
        elif item.type == "function_call":
            assert item.call_id is not None and item.name is not None
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments or ""}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            parts = item.output or []
            msg: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": item.call_id,
                "content": "\n".join(p.as_text() for p in parts if p.type == "input_text"),
            }
            if item.call_id in names:
                msg["name"] = names[item.call_id]
            out.append(msg)
            pending_images += [_image(p) for p in parts if p.type == "input_image"]
    flush_images()
    return out


def to_chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The OpenAI chat-completions body for a Responses request: instructions -> a system message;
    tools (flat) -> chat tools; tool_choice -> chat tool_choice (allowed_tools keeps only the
    listed tools, with its mode); max_output_tokens -> max_tokens; text.format -> response_format;
    reasoning.effort -> reasoning_effort (for chat templates that read it)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    tools = list(req.tools or ())
    choice = req.tool_choice
    if isinstance(choice, dict) and choice["type"] == "allowed_tools":
        allowed = {t["name"] for t in choice["tools"]}
        tools = [t for t in tools if t.name in allowed]
        choice = choice["mode"]
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    "parameters": t.parameters if t.parameters is not None else {"type": "object", "properties": {}},
                    **({"strict": t.strict} if t.strict is not None else {}),
                },
            }
            for t in tools
        ]
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    body["stream"] = bool(req.stream)
    return body
