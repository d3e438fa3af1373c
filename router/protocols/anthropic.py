"""Anthropic's Messages API for Orchard: POST /v1/messages and /v1/messages/count_tokens.

A request is translated into an OpenAI chat-completions body (`to_chat_request`), so Anthropic
clients reach every chat model through the same validation, template and generation path as OpenAI
clients; the output events of that generation (router.protocols.events) are encoded back into
Anthropic's message object (`message_response`) or its SSE stream (`MessageStreamEncoder`). Pure
(pydantic + stdlib): no Ray, no MLX, no web framework.

Field policy, as Anthropic's own API: an unknown top-level key is a 400 (Anthropic rejects extra
inputs too, so a client that works against Anthropic sends none). Fields Anthropic defines that do
not change what a local model produces (metadata, cache_control, service_tier, ...) are accepted and
ignored; features Orchard cannot provide (server tools, documents, files, containers) are a 400
naming the field. Nested blocks ignore unknown keys (citations, cache_control, caller, ...), so a
response message sent back as history (`message.to_param()`) is accepted as is."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.protocols.events import (
    Finish,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from router.protocols.openai import ENGINE_STATUS, MAX_STOP, ProtocolError, parse_body, reject as _reject

# ---- errors ------------------------------------------------------------------------------------

AnthropicErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
]


def error_type(status: int, code: str | None = None) -> AnthropicErrorType:
    """Anthropic's error `type` for an HTTP status. 503 is overloaded_error (the model is stopped or
    busy: retry later), except a model that failed to load (code load_failed), an api_error."""
    by_status: dict[int, AnthropicErrorType] = {
        401: "authentication_error",
        402: "billing_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        504: "timeout_error",
        529: "overloaded_error",
    }
    if status in by_status:
        return by_status[status]
    if status == 503:
        return "api_error" if code == "load_failed" else "overloaded_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}: Anthropic's error body (HTTP and SSE)."""
    return {"type": "error", "error": {"type": error_type(status, code), "message": message}}


def protocol_error_body(error: ProtocolError) -> dict[str, Any]:
    """The Anthropic body for a ProtocolError (raised by the parsers here, by the shared chat
    validation, or for an engine error); the HTTP status is `error.status`."""
    return error_body(error.status, error.message, error.code)


def _path(loc: Iterable[Any]) -> str:
    """('messages', 0, 'content') -> 'messages.0.content' (Anthropic's spelling)."""
    return ".".join(str(p) for p in loc)


def validation_error(error: ValidationError | Sequence[Mapping[str, Any]]) -> ProtocolError:
    """Pydantic errors (or FastAPI's RequestValidationError.errors(), locations starting with
    "body") -> one 400 invalid_request_error naming the first bad field, as Anthropic does:
    "messages.0.content.1.source: Field required"."""
    errors = error.errors() if isinstance(error, ValidationError) else list(error)
    if not errors:
        return ProtocolError(400, "invalid_request", "invalid request", type="invalid_request_error")
    first = errors[0]
    loc = list(first.get("loc") or ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    ctx = first.get("ctx") or {}
    if first.get("type") == "orchard" and ctx.get("at"):
        loc += str(ctx["at"]).split(".")
    path = _path(loc)
    msg = str(first.get("msg") or "invalid value").removeprefix("Value error, ")
    if first.get("type") in ("model_type", "dict_type") and not path:
        msg = "The request body must be a JSON object."
    message = f"{path}: {msg}" if path else msg
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request)"
    code = ctx.get("code") if first.get("type") == "orchard" else "invalid_request"
    return ProtocolError(400, code or "invalid_request", message, path or None, type="invalid_request_error")


# ---- request models ------------------------------------------------------------------------------


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

    name: str = Field(min_length=1)
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
    def _tool_choice(self) -> CountTokensRequest:
        choice, names = self.tool_choice, {t.name for t in self.tools or ()}
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


# ---- translation to an OpenAI chat body ----------------------------------------------------------


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


# ---- responses ---------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def count_tokens_response(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


def stop_reason(finish: Finish) -> str:
    """Finish -> Anthropic stop_reason: stop -> end_turn (stop_sequence when a stop string ended it),
    length -> max_tokens, tool_calls -> tool_use."""
    if finish.reason == "length":
        return "max_tokens"
    if finish.reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def finish_error(finish: Finish, statuses: Mapping[str, int] | None = None) -> ProtocolError | None:
    """The error a Finish reports (reason error / cancelled), or None."""
    if finish.reason == "cancelled":
        return ProtocolError(499, "cancelled", "the request was cancelled")
    if finish.reason != "error":
        return None
    code = finish.error_code or "internal"
    return ProtocolError((statuses or ENGINE_STATUS).get(code, 500), code, finish.error or "generation failed")


def _usage(finish: Finish) -> dict[str, int]:
    """Anthropic counts input_tokens without cache reads (total input = input_tokens +
    cache_read_input_tokens); the engine's prompt_tokens include them."""
    cached = min(finish.cached_tokens, finish.prompt_tokens)
    return {
        "input_tokens": finish.prompt_tokens - cached,
        "output_tokens": finish.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as the `input` object ("" is {}). Anything else is a 500: the
    tool-call parser hands over only calls it could read, so this is a server fault."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ProtocolError(500, "internal", "the model's tool call arguments are not a JSON object")
    return value


def _sse(data: Mapping[str, Any]) -> bytes:
    """One event as Anthropic sends it: `event: <type>` and the JSON data (the SDK reads both)."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {data['type']}\ndata: {payload}\n\n".encode()


class MessageStreamEncoder:
    """Output events of one generation -> Anthropic's SSE stream:

        message_start, (content_block_start, content_block_delta*, content_block_stop)*,
        message_delta (stop_reason, stop_sequence, usage), message_stop

    Blocks are numbered in order of appearance; reasoning becomes a thinking block (signature ""
    and no signature_delta: there is no Anthropic signature to give, and the SDK needs none), text a
    text block, a tool call a tool_use block streamed as input_json_delta. A text or thinking block
    closes when another block starts; a tool_use block at its ToolCallEnd; anything open at Finish.

    Input tokens: the prompt's count is exact only at Finish. message_start carries `input_tokens`
    given to the constructor (the router may know it from tokenising; else 0), and message_delta
    carries the final input / cache-read counts, which the SDK takes over (they are cumulative).

    Errors: a Finish with reason "error" (or `error()`) sends Anthropic's `error` event and nothing
    after it; "cancelled" sends nothing (the client is gone). `close()` sends an error event if the
    events stopped before a Finish.

        enc = MessageStreamEncoder(model, message_id, input_tokens=n)
        yield enc.start()                      # optional: message_start before the first token
        async for event in events: yield enc.feed(event)
        yield enc.close()
    """

    def __init__(self, model: str, message_id: str, *, input_tokens: int = 0, statuses: Mapping[str, int] | None = None):
        self.model = model
        self.message_id = message_id
        self.input_tokens = input_tokens
        self.statuses = statuses
        self.started = False
        self.done = False  # message_stop, an error event or a cancel: nothing more is sent
        self.content: list[dict[str, Any]] = []  # blocks as built so far (tool input as raw JSON text)
        self._open: dict[Any, int] = {}  # "text" / "thinking" / ("tool", call index) -> block index
        self.finish: Finish | None = None

    # -- building -------------------------------------------------------------------------------

    def _start_message(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return [
            {
                "type": "message_start",
                "message": {
                    "id": self.message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                },
            }
        ]

    def _close(self, key: Any) -> list[dict[str, Any]]:
        index = self._open.pop(key, None)
        return [] if index is None else [{"type": "content_block_stop", "index": index}]

    def _open_block(self, key: Any, block: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.content)
        self.content.append(dict(block))
        self._open[key] = index
        return [{"type": "content_block_start", "index": index, "content_block": block}]

    def _events(self, event: OutputEvent) -> list[dict[str, Any]]:
        if isinstance(event, Finish) and event.reason == "cancelled":
            self.finish, self.done = event, True  # the client is gone: nothing more to send
            return []
        out = self._start_message()
        if isinstance(event, TextDelta | ReasoningDelta):
            if not event.text:
                return out
            key, other = ("text", "thinking") if isinstance(event, TextDelta) else ("thinking", "text")
            out += self._close(other)
            if key not in self._open:
                block = {"type": "text", "text": ""} if key == "text" else {"type": "thinking", "thinking": "", "signature": ""}
                out += self._open_block(key, block)
            index = self._open[key]
            self.content[index][key] += event.text
            delta = {"type": "text_delta", "text": event.text} if key == "text" else {"type": "thinking_delta", "thinking": event.text}
            out.append({"type": "content_block_delta", "index": index, "delta": delta})
        elif isinstance(event, ToolCallStart):
            out += self._close("text") + self._close("thinking") + self._close(("tool", event.index))
            out += self._open_block(("tool", event.index), {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
            self.content[-1]["arguments"] = ""
        elif isinstance(event, ToolCallArguments):
            open_at = self._open.get(("tool", event.index))
            if open_at is not None and event.arguments:
                self.content[open_at]["arguments"] += event.arguments
                out.append({"type": "content_block_delta", "index": open_at, "delta": {"type": "input_json_delta", "partial_json": event.arguments}})
        elif isinstance(event, ToolCallEnd):
            out += self._close(("tool", event.index))
        elif isinstance(event, Finish):
            self.finish = event
            error = finish_error(event, self.statuses)
            if error is not None:
                self.done = True
                return out + [error_body(error.status, error.message, error.code)]
            for key in sorted(self._open, key=self._open.__getitem__):
                out += self._close(key)
            usage = _usage(event)
            out.append({"type": "message_delta", "delta": {"stop_reason": stop_reason(event), "stop_sequence": event.stop_sequence}, "usage": usage})
            out.append({"type": "message_stop"})
            self.done = True
        return out

    # -- the stream ------------------------------------------------------------------------------

    def start(self) -> bytes:
        """message_start now (before the first token), if not sent yet."""
        return b"" if self.done else b"".join(_sse(e) for e in self._start_message())

    def ping(self) -> bytes:
        """A keep-alive (Anthropic's `ping` event; clients skip it): e.g. while a model loads."""
        return b"" if self.done else b"".join(_sse(e) for e in self._start_message()) + _sse({"type": "ping"})

    def feed(self, event: OutputEvent) -> bytes:
        if self.done:
            return b""
        return b"".join(_sse(e) for e in self._events(event))

    def error(self, status: int, message: str, code: str | None = None) -> bytes:
        """An error event for a failure outside the events (the model actor died mid-stream, ...)."""
        if self.done:
            return b""
        self.done = True
        return b"".join(_sse(e) for e in self._start_message()) + _sse(error_body(status, message, code))

    def close(self) -> bytes:
        return self.error(500, "the stream ended without a finish reason", "internal")

    def message(self) -> dict[str, Any]:
        """The message built so far (after a Finish: the whole message, as message_response)."""
        content = []
        for block in self.content:
            if block["type"] == "tool_use":
                block = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": tool_input(block["arguments"])}
            content.append(block)
        finish = self.finish if self.finish is not None and self.finish.reason in ("stop", "length", "tool_calls") else None
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(finish) if finish else None,
            "stop_sequence": finish.stop_sequence if finish else None,
            "usage": _usage(finish) if finish else {"input_tokens": self.input_tokens, "output_tokens": 0},
        }


def message_response(model: str, message_id: str, events: Iterable[OutputEvent], *, statuses: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The Message for a whole generation (non-streaming). An error / cancelled Finish raises its
    ProtocolError (answer it with `protocol_error_body`), as does a generation without a Finish."""
    enc = MessageStreamEncoder(model, message_id, statuses=statuses)
    for event in events:
        enc._events(event)
    if enc.finish is None:
        raise ProtocolError(500, "internal", "generation ended without a finish reason")
    error = finish_error(enc.finish, statuses)
    if error is not None:
        raise error
    return enc.message()
