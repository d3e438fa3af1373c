"""A Messages (or count_tokens) request -> an OpenAI chat-completions body: turns become chat messages
(tool results as role "tool"), tools and tool_choice the chat ones, thinking the template's switch."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from router.protocols.anthropic.requests import ContentBlock, CountTokensRequest, MessagesRequest


def _text(blocks: Iterable[ContentBlock]) -> str:
    return "\n".join(b.text or "" for b in blocks if b.type == "text")


def _image(block: ContentBlock) -> dict[str, Any]:
    assert block.source is not None
    return {"type": "image_url", "image_url": {"url": block.source.url_for_chat()}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A lone text part as a plain string (what every chat template takes), else the parts."""
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _user_turn(blocks: list[ContentBlock], tool_names: Mapping[str, str]) -> list[dict[str, Any]]:
    """A user turn -> its tool_result blocks as role "tool" messages (in order), then one user
    message with the rest. Images inside a tool result go to that user message (chat tool messages
    carry text only), ahead of the turn's own blocks. Anthropic puts tool results first in a turn."""
    tools, images, parts = [], [], []
    for block in blocks:
        if block.type == "tool_result":
            inner = block.content or []
            text = _text(inner)
            if block.is_error:
                text = f"Error: {text}" if text else "Error"
            msg: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
            if block.tool_use_id is not None and block.tool_use_id in tool_names:
                msg["name"] = tool_names[block.tool_use_id]
            tools.append(msg)
            images += [_image(b) for b in inner if b.type == "image"]
        elif block.type == "text":
            parts.append({"type": "text", "text": block.text or ""})
        else:
            parts.append(_image(block))
    out = tools
    if images or parts:
        out.append({"role": "user", "content": _content(images + parts)})
    return out


def _assistant_turn(blocks: list[ContentBlock], tool_names: dict[str, str]) -> dict[str, Any]:
    """An assistant turn -> one assistant message: text, and tool_use blocks as tool_calls.
    Thinking blocks are dropped: open-model chat templates strip past reasoning themselves, and
    replaying it as visible text would teach the model answers it never gave."""
    parts = [{"type": "text", "text": b.text or ""} for b in blocks if b.type == "text"]
    msg: dict[str, Any] = {"role": "assistant", "content": _content(parts) if parts else None}
    calls = []
    for b in blocks:
        if b.type == "tool_use":
            assert b.id is not None and b.name is not None
            tool_names[b.id] = b.name
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (system first)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system)})
    tool_names: dict[str, str] = {}
    for m in req.messages:
        if m.role == "user":
            out += _user_turn(m.content, tool_names)
        elif m.role == "assistant":
            out.append(_assistant_turn(m.content, tool_names))
        else:
            out.append({"role": "system", "content": _text(m.content)})
    return out


def to_chat_request(req: CountTokensRequest) -> dict[str, Any]:
    """The OpenAI chat-completions body for a Messages (or count_tokens) request. tool_choice: auto
    -> "auto", any -> "required", tool -> the named function, none -> "none";
    disable_parallel_tool_use -> parallel_tool_calls false; stop_sequences -> stop; thinking ->
    chat_template_kwargs.enable_thinking; output_config.format -> response_format json_schema."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    "parameters": t.input_schema,
                    **({"strict": t.strict} if t.strict is not None else {}),
                },
            }
            for t in req.tools
        ]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": choice.name},
            }
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    fmt = req.output_format or (req.output_config.format if req.output_config else None)
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if req.output_config is not None and req.output_config.effort is not None:
        body["reasoning_effort"] = req.output_config.effort
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        body["stream"] = bool(req.stream)
    return body
