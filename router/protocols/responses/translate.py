"""A Responses request -> the OpenAI chat request (typed, not validated again: the Responses
request's own validation holds every rule the chat request has, router.protocols.openai.build):
instructions and input items as chat messages, flat tools as chat tools, text.format as
response_format."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from router.protocols.openai import ChatCompletionRequest, ChatMessage, ContentPart as ChatPart, build
from router.protocols.responses.requests import ContentPart, FunctionTool, ResponsesRequest


def _image(part: ContentPart) -> ChatPart:
    assert part.image_url is not None
    return build.image(part.image_url, part.detail if part.detail in ("auto", "low", "high") else None)  # type: ignore[arg-type]  # narrowed by the test


def _parts(parts: Iterable[ContentPart]) -> list[ChatPart]:
    return [_image(p) if p.type == "input_image" else build.text(p.as_text()) for p in parts]


_ROLE = {"developer": "system"}


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` and `input` as OpenAI chat messages. Consecutive function_call items join the
    assistant message before them (one turn, several tool_calls; a custom_tool_call is a call of
    its function of one string, `{"input": ...}`; a namespace's function is called by the name the
    model was offered); a function_call_output (or custom_tool_call_output) becomes a role "tool" message, and its images a user message after the turn's tool messages (chat tool
    messages carry text only). Reasoning items are dropped: open-model chat templates strip past
    reasoning themselves, and Orchard's reasoning items carry no encrypted state to restore."""
    out: list[ChatMessage] = []
    if req.instructions is not None:
        out.append(build.message("system", req.instructions))
    names: dict[str, str] = {}
    pending_images: list[ChatPart] = []

    def flush_images() -> None:
        if pending_images:
            out.append(build.message("user", list(pending_images)))
            pending_images.clear()

    model_name = {(t.namespace, t.tool_name): t.name for t in req.function_tools}
    for item in req.input:
        if item.type not in ("function_call_output", "custom_tool_call_output"):
            flush_images()
        if item.type == "message":
            assert item.role is not None
            out.append(build.message(_ROLE.get(item.role, item.role), _parts(item.content or ())))  # type: ignore[arg-type]  # developer is mapped
        elif item.type in ("function_call", "custom_tool_call"):
            assert item.call_id is not None and item.name is not None
            name = model_name.get((item.namespace, item.name), item.name)
            names[item.call_id] = name
            arguments = item.arguments or "" if item.type == "function_call" else json.dumps({"input": item.input or ""}, ensure_ascii=False)
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                out.append(build.message("assistant", None, tool_calls=[call]))
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            parts = item.output or []
            named = {"name": names[item.call_id]} if item.call_id in names else {}
            text = "\n".join(p.as_text() for p in parts if p.type == "input_text")
            out.append(build.message("tool", text, tool_call_id=item.call_id, **named))
            pending_images += [_image(p) for p in parts if p.type == "input_image"]
    flush_images()
    return out


# No max_output_tokens means "up to the context" on OpenAI's Responses API, and Codex never sends one: the
# engine clamps this to the room the prompt leaves (docs/protocols.md). A number, not the context itself, so
# a key's tokens-per-minute reservation stays bounded (as for Claude Code's max_tokens of 32000).
UNBOUNDED_OUTPUT_TOKENS = 32768


def _description(tool: FunctionTool) -> str | None:
    if not tool.custom:
        return tool.description
    note = "A freeform tool: put its whole input, as plain text, in the string `input`."
    return f"{tool.description}\n\n{note}" if tool.description else note


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The OpenAI chat request for a Responses request: instructions -> a system message; tools
    (flat) -> chat tools; tool_choice -> chat tool_choice (allowed_tools keeps only the listed
    tools, with its mode); max_output_tokens -> max_tokens; text.format -> response_format;
    reasoning.effort -> reasoning_effort (for chat templates that read it)."""
    fields: dict[str, Any] = {}
    tools = req.function_tools
    by_name = {t.tool_name: t.name for t in tools if t.namespace is None} | {t.name: t.name for t in tools}
    choice = req.tool_choice
    if isinstance(choice, dict) and choice["type"] == "allowed_tools":
        allowed = {by_name.get(t["name"], t["name"]) for t in choice["tools"]}
        tools = [t for t in tools if t.name in allowed]
        choice = choice["mode"]
    if tools:
        empty = {"type": "object", "properties": {}}
        fields["tools"] = [build.tool(t.name, t.parameters if t.parameters is not None else empty, _description(t), t.strict) for t in tools]
        if choice is not None:
            fields["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": by_name.get(choice["name"], choice["name"])}}
            )
        if req.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = build.json_object_format()
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.name is not None and fmt.schema_ is not None  # TextFormat._schema
        fields["response_format"] = build.json_schema_format(fmt.name, fmt.schema_, fmt.description, fmt.strict)
    if req.reasoning is not None and req.reasoning.effort is not None:
        fields["reasoning_effort"] = req.reasoning.effort
    fields["max_tokens"] = req.max_output_tokens or UNBOUNDED_OUTPUT_TOKENS
    if req.prompt_cache_key:
        fields["prompt_cache_key"] = req.prompt_cache_key  # the instance affinity's conversation key (router.serving.affinity)
    fields |= {name: getattr(req, name) for name in ("temperature", "top_p", "top_k") if getattr(req, name) is not None}
    fields["stream"] = bool(req.stream)
    return build.chat_request(req.model, chat_messages(req), **fields)
