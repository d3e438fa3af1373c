"""A Messages (or count_tokens) request -> the OpenAI chat request (typed, not validated again: the
Messages request's own validation holds every rule the chat request has, router.protocols.openai.build):
turns become chat messages (tool results as role "tool"), tools and tool_choice the chat ones,
thinking the template's switch."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from router.protocols.anthropic.requests import ContentBlock, CountTokensRequest, MessagesRequest
from router.protocols.openai import ChatCompletionRequest, ChatMessage, ContentPart, build


def _text(blocks: Iterable[ContentBlock]) -> str:
    return "\n".join(b.text or "" for b in blocks if b.type == "text")


BILLING_LINE = "x-anthropic-billing-header:"


def _system_text(blocks: Iterable[ContentBlock]) -> str:
    """The system prompt's text without Claude Code's attribution line: a text block (or a first
    line) starting with `x-anthropic-billing-header:`, whose `cc_version=<version>.<hash>` changes
    with every request. Left in, it would make every request's prompt differ from its first tokens,
    and no prefix cache could serve any of it. It says nothing to the model."""
    kept = []
    for b in blocks:
        if b.type == "text" and (b.text or "").startswith(BILLING_LINE):
            rest = (b.text or "").partition("\n")[2]
            if not rest:
                continue
            b = b.model_copy(update={"text": rest})
        kept.append(b)
    return _text(kept)


def _image(block: ContentBlock) -> ContentPart:
    assert block.source is not None
    return build.image(block.source.url_for_chat())


def _user_turn(blocks: list[ContentBlock], tool_names: Mapping[str, str]) -> list[ChatMessage]:
    """A user turn -> its tool_result blocks as role "tool" messages (in order), then one user
    message with the rest. Images inside a tool result go to that user message (chat tool messages
    carry text only), ahead of the turn's own blocks. Anthropic puts tool results first in a turn."""
    out: list[ChatMessage] = []
    images: list[ContentPart] = []
    parts: list[ContentPart] = []
    for block in blocks:
        if block.type == "tool_result":
            inner = block.content or []
            text = _text(inner)
            if block.is_error:
                text = f"Error: {text}" if text else "Error"
            named = {"name": tool_names[block.tool_use_id]} if block.tool_use_id is not None and block.tool_use_id in tool_names else {}
            out.append(build.message("tool", text, tool_call_id=block.tool_use_id, **named))
            images += [_image(b) for b in inner if b.type == "image"]
        elif block.type == "text":
            parts.append(build.text(block.text or ""))
        else:
            parts.append(_image(block))
    if images or parts:
        out.append(build.message("user", images + parts))
    return out


def _assistant_turn(blocks: list[ContentBlock], tool_names: dict[str, str]) -> ChatMessage:
    """An assistant turn -> one assistant message: text, and tool_use blocks as tool_calls.
    Thinking blocks are dropped: open-model chat templates strip past reasoning themselves, and
    replaying it as visible text would teach the model answers it never gave."""
    parts = [build.text(b.text or "") for b in blocks if b.type == "text"]
    calls = []
    for b in blocks:
        if b.type == "tool_use":
            assert b.id is not None and b.name is not None
            tool_names[b.id] = b.name
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
    if calls:
        return build.message("assistant", parts or None, tool_calls=calls)
    return build.message("assistant", parts or "")


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as OpenAI chat messages (system first)."""
    out: list[ChatMessage] = []
    if req.system is not None:
        out.append(build.message("system", _system_text(req.system)))
    tool_names: dict[str, str] = {}
    for m in req.messages:
        if m.role == "user":
            out += _user_turn(m.content, tool_names)
        elif m.role == "assistant":
            out.append(_assistant_turn(m.content, tool_names))
        else:
            out.append(build.message("system", _system_text(m.content)))
    return out


def _tool_choice(req: CountTokensRequest) -> dict[str, Any]:
    """tool_choice: auto -> "auto", any -> "required", tool -> the named function, none -> "none";
    disable_parallel_tool_use -> parallel_tool_calls false."""
    choice = req.tool_choice
    if choice is None:
        return {}
    out: dict[str, Any] = {
        "tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
    }
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request for a Messages (or count_tokens) request: tools and tool_choice the
    chat ones; stop_sequences -> stop; thinking -> chat_template_kwargs.enable_thinking;
    output_config.format -> response_format json_schema; output_config.effort -> reasoning_effort."""
    fields: dict[str, Any] = {}
    if req.tools:
        fields["tools"] = [build.tool(t.name, t.input_schema or {}, t.description, t.strict) for t in req.tools]
        fields |= _tool_choice(req)
    fmt = req.output_format or (req.output_config.format if req.output_config else None)
    if fmt is not None:
        fields["response_format"] = build.json_schema_format("output", fmt.schema_)
    if req.output_config is not None and req.output_config.effort is not None:
        fields["reasoning_effort"] = req.output_config.effort
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        if req.metadata is not None and req.metadata.user_id:
            fields["prompt_cache_key"] = req.metadata.user_id  # the instance affinity's conversation key (router.serving.affinity)
        fields["max_tokens"] = req.max_tokens
        fields |= {name: getattr(req, name) for name in ("temperature", "top_p", "top_k") if getattr(req, name) is not None}
        if req.stop_sequences:
            fields["stop"] = list(req.stop_sequences)
        fields["stream"] = bool(req.stream)
    return build.chat_request(req.model, chat_messages(req), **fields)
