"""Typed chat requests built from another protocol's request (the Anthropic and Responses adapters).

A request is validated once, by the model of the protocol the client spoke, so its errors name that
protocol's fields (`tools.0.input_schema`, `input[2].call_id`). The adapters then build the chat
request from those validated values with these constructors, which do not validate again: what
they are given must already satisfy the chat request's rules (tests/test_protocol_adapters.py checks
that validating a built request's JSON gives back the same request, for every adapter test case)."""

from __future__ import annotations

from typing import Any, Literal

from router.protocols.openai.parts import ChatMessage, ContentPart, FunctionDefinition, ImageURL, JSONSchemaFormat, ResponseFormat, Tool
from router.protocols.openai.requests import ChatCompletionRequest

Role = Literal["system", "user", "assistant", "tool"]


def text(value: str) -> ContentPart:
    return ContentPart.model_construct(type="text", text=value)


def image(url: str, detail: Literal["auto", "low", "high"] | None = None) -> ContentPart:
    fields: dict[str, Any] = {"url": url} | ({"detail": detail} if detail is not None else {})
    return ContentPart.model_construct(type="image_url", image_url=ImageURL.model_construct(**fields))


def message(role: Role, content: str | list[ContentPart] | None, **fields: Any) -> ChatMessage:
    """A chat message; a string is one text part, as the chat model keeps it. `fields`: name,
    tool_call_id, tool_calls (the OpenAI dicts, as the chat model keeps them)."""
    parts = [text(content)] if isinstance(content, str) else content
    return ChatMessage.model_construct(role=role, content=parts, **fields)


def tool(name: str, parameters: dict[str, Any], description: str | None = None, strict: bool | None = None) -> Tool:
    function = FunctionDefinition.model_construct(name=name, description=description, parameters=parameters, strict=strict)
    return Tool.model_construct(type="function", function=function)


def json_schema_format(name: str, schema: dict[str, Any], description: str | None = None, strict: bool | None = None) -> ResponseFormat:
    fmt = JSONSchemaFormat.model_construct(name=name, description=description, schema_=schema, strict=strict)
    return ResponseFormat.model_construct(type="json_schema", json_schema=fmt)


def json_object_format() -> ResponseFormat:
    return ResponseFormat.model_construct(type="json_object")


def chat_request(model: str, messages: list[ChatMessage], **fields: Any) -> ChatCompletionRequest:
    """The chat request with these (already valid, already typed) fields; the others at their
    defaults. tool_choice in its normalised form: 'none' | 'auto' | 'required' | {'type':
    'function', 'function': {'name': ...}}."""
    return ChatCompletionRequest.model_construct(model=model, messages=messages, **fields)
