"""Anthropic's request bodies: /v1/messages and /v1/messages/count_tokens, with their content blocks,
tools, tool_choice, thinking and output format.

Field policy, as Anthropic's own API: an unknown top-level key is a 400 (Anthropic rejects extra
inputs too, so a client that works against Anthropic sends none). Fields Anthropic defines that do
not change what a local model produces (metadata, cache_control, service_tier, ...) are accepted and
ignored; features Orchard cannot provide (server tools, documents, files, containers) are a 400
naming the field. Nested blocks ignore unknown keys (citations, cache_control, caller, ...), so a
response message sent back as history (`message.to_param()`) is accepted as is."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.protocols.anthropic.errors import validation_error
from router.protocols.openai import MAX_STOP, object_schema_error, parse_body, reject as _reject


class _Part(BaseModel):
    """Nested objects: unknown keys ignored (cache_control, citations, caller: never change output)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class ImageSource(_Part):
    type: Literal["base64", "url", "file"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "file":
            raise _reject("file sources (the Files API) are not supported; send base64 data or a URL", "type")
        if self.type == "base64" and (not self.data or self.media_type is None):
            raise _reject("a base64 image source needs 'media_type' and 'data'", "data", "missing")
        if self.type == "url" and not self.url:
            raise _reject("a url image source needs 'url'", "url", "missing")
        return self

    def url_for_chat(self) -> str:
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else str(self.url)


# Block types Anthropic defines that Orchard cannot serve (server tools, documents, containers).
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks (PDF / file input) are not supported; send text or images",
    "search_result": "search_result blocks are not supported",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
    "web_fetch_tool_result": "server tools are not supported",
    "code_execution_tool_result": "server tools are not supported",
    "bash_code_execution_tool_result": "server tools are not supported",
    "text_editor_code_execution_tool_result": "server tools are not supported",
    "tool_search_tool_result": "server tools are not supported",
    "container_upload": "containers are not supported",
    "tool_reference": "tool references are not supported",
    "browser_state": "browser tools are not supported",
}
_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
_BLOCKS_BY_ROLE = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
}


class ContentBlock(_Part):
    """One content block. One model for every block type (not a union), so a bad block is reported
    at its own path ("messages.2.content.0.source") rather than under a union tag."""

    type: str
    text: str | None = None
    source: ImageSource | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: list[ContentBlock] | None = None  # tool_result (a string becomes one text block)
    is_error: bool | None = None
    thinking: str | None = None  # thinking (history only: dropped, see to_chat_request)
    signature: str | None = None
    data: str | None = None  # redacted_thinking

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        """The type first, so a block Orchard cannot serve is named as such, not by its fields."""
        kind = v.get("type") if isinstance(v, dict) and isinstance(v.get("type"), str) else None  # a list is unhashable
        if kind in _UNSUPPORTED_BLOCKS:
            raise _reject(_UNSUPPORTED_BLOCKS[kind], "type")
        if isinstance(kind, str) and kind not in _BLOCKS:
            raise _reject(f"unknown content block type '{kind}'", "type", "invalid_value")
        return v

    @model_validator(mode="after")
    def _by_type(self) -> ContentBlock:
        need = {"text": ("text",), "image": ("source",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        for name in need.get(self.type, ()):
            if getattr(self, name) is None:
                raise _reject("Field required", name, "missing")
        if self.type == "tool_result":
            for j, block in enumerate(self.content or ()):
                if block.type not in ("text", "image"):
                    raise _reject(f"tool_result content takes text or image blocks, not {block.type}", f"content.{j}.type")
        return self


class Message(_Part):
    """A turn. `content` is kept as a list of blocks (a string becomes one text block)."""

    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        allowed = _BLOCKS_BY_ROLE[self.role]
        for j, block in enumerate(self.content):
            if block.type not in allowed:
                raise _reject(f"{self.role} messages take {', '.join(allowed)} blocks, not {block.type}", f"content.{j}.type", "invalid_value")
        return self


class Tool(_Part):
    """A client tool. Server tools (bash, web search, code execution, ...) carry a versioned `type`
    and run on Anthropic's side: a 400 here."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # Anthropic's rule; within the chat request's
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _client_tool(self) -> Tool:
        if self.type not in (None, "custom"):
            raise _reject(f"server tools are not supported (type '{self.type}'); define a client tool with name and input_schema", "type")
        if self.input_schema is None:
            raise _reject("Field required", "input_schema", "missing")
        error = object_schema_error(self.input_schema)
        if error is not None:
            raise _reject(error.replace("a function's parameters", "input_schema"), "input_schema", "invalid_value")
        return self


class ToolChoice(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise _reject("Field required", "name", "missing")
        return self


class Thinking(_Part):
    """Extended thinking. A local model thinks as its chat template allows: `enabled` (and
    adaptive / between_tools) turns the template's thinking switch on, `disabled` off;
    `budget_tokens` cannot be enforced (the model ends its reasoning itself) and is ignored."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: str | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise _reject("Field required", "budget_tokens", "missing")
        return self


class OutputFormat(_Part):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Part):
    format: OutputFormat | None = None
    effort: str | None = None


class Metadata(_Part):
    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: everything that makes up the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: list[ContentBlock] | None = None  # a string becomes one text block
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format
    # Accepted and ignored: caching, routing and billing hints that do not change the output.
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    context_management: dict[str, Any] | None = None  # beta: server-side context editing; never needed here
    # Features Orchard cannot provide: a 400 when set.
    container: Any = None
    mcp_servers: list[Any] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        for j, block in enumerate(v if isinstance(v, list) else ()):
            if isinstance(block, dict) and block.get("type") != "text":
                raise _reject(f"system takes text blocks, not {block.get('type')}", f"{j}.type", "invalid_value")
        return v

    @field_validator("container")
    @classmethod
    def _no_container(cls, v: Any) -> Any:
        if v is not None:
            raise _reject("containers (code execution) are not supported")
        return v

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp(cls, v: Any) -> Any:
        if v:
            raise _reject("MCP servers are not supported; define client tools instead")
        return v

    @model_validator(mode="after")
    def _turns_have_content(self) -> CountTokensRequest:
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            if not m.content and not (i == last and m.role == "assistant"):
                raise _reject(
                    "all messages must have non-empty content except for the optional final assistant message",
                    f"messages.{i}.content",
                    "invalid_value",
                )
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> CountTokensRequest:
        tools = [t.name for t in self.tools or ()]
        if len(set(tools)) != len(tools):
            raise _reject("tool names must be unique", "tools", "invalid_value")
        choice, names = self.tool_choice, set(tools)
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise _reject(f"tool_choice '{choice.type}' needs tools", "tool_choice.type", "invalid_value")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise _reject(f"tool '{choice.name}' is not in tools", "tool_choice.name", "invalid_value")
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    inference_geo: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        v = [s for s in v if s]
        if len(v) > MAX_STOP:
            raise _reject(f"at most {MAX_STOP} stop sequences, got {len(v)}", code="invalid_value")
        return v


def parse_messages_request(body: Any) -> MessagesRequest:
    """A /v1/messages request from JSON bytes / str or a dict; ProtocolError (400) if it is bad."""
    return parse_body(MessagesRequest, body, validation_error)


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    return parse_body(CountTokensRequest, body, validation_error)
