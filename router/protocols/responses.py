"""OpenAI's Responses API for Orchard: POST /v1/responses, stateless.

A request is translated into an OpenAI chat-completions body (`to_chat_request`), so it reaches
every chat model through the chat path's validation, template and generation; the generation's
output events (router.protocols.events) are encoded back as a Response object (`response_object`) or
the Responses SSE stream (`ResponseStreamEncoder`). Pure (pydantic + stdlib).

Stateless: Orchard keeps no responses. `store` (true by default in the SDK) is accepted and
ignored, and the Response says `"store": false`; what needs a stored response or conversation
(`previous_response_id`, `conversation`, `item_reference` items, `background`, stored `prompt`
templates) is a 400 naming the field, since ignoring it would silently drop the earlier context.
Clients send the whole conversation in `input`, as they do with store=false.

Field policy follows router.protocols.openai (the chat endpoint): documented fields that do not
change the output (user, metadata, include, truncation, service_tier, prompt_cache_key, ...) are
accepted and ignored, as are keys OpenAI does not document (`ignored_fields`); `top_k` is the one
local-server extra honoured. Built-in tools (web search, file search, computer use, MCP, ...) and
input files / audio are a 400. Errors use OpenAI's body (router.protocols.openai.error_body) with
OpenAI's param spelling (`input[2].content[0].image_url`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.protocols.events import (
    Finish,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from router.protocols.openai import ENGINE_STATUS, ProtocolError, error_type, parse_body, reject as _reject

# ---- request models ------------------------------------------------------------------------------


class _Part(BaseModel):
    """Nested objects: unknown keys ignored (ids, statuses, annotations: never change output)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


_PART_TYPES = ("input_text", "input_image", "output_text", "refusal", "summary_text", "reasoning_text")
_UNSUPPORTED_PARTS = {"input_file": "file inputs are not supported", "input_audio": "audio input is not supported"}


class ContentPart(_Part):
    """One content part of a message (or of a function_call_output). One model for every part type,
    so a bad part is reported at its own path."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    refusal: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) and isinstance(v.get("type"), str) else None  # a list is unhashable
        if kind in _UNSUPPORTED_PARTS:
            raise _reject(_UNSUPPORTED_PARTS[kind], "type")
        if isinstance(kind, str) and kind not in _PART_TYPES:
            raise _reject(f"unknown content part type '{kind}'", "type", "invalid_value")
        return v

    @model_validator(mode="after")
    def _payload(self) -> ContentPart:
        if self.type == "input_image":
            if self.image_url is None:
                msg = "image file_id (the Files API) is not supported; send image_url" if self.file_id else "an input_image part needs 'image_url'"
                raise _reject(
                    msg, "image_url" if not self.file_id else "file_id", "unsupported_value" if self.file_id else "missing_required_parameter"
                )
        elif self.type == "refusal":
            if self.refusal is None:
                raise _reject("a refusal part needs 'refusal'", "refusal", "missing_required_parameter")
        elif self.text is None:
            raise _reject(f"a {self.type} part needs 'text'", "text", "missing_required_parameter")
        return self

    def as_text(self) -> str:
        return self.refusal or "" if self.type == "refusal" else self.text or ""


_PARTS_BY_ROLE = {
    "user": ("input_text", "input_image"),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "refusal", "input_text"),
}
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputItem(_Part):
    """One item of `input`: a message (EasyInputMessage: no `type` needed), a function_call the
    model made, a function_call_output, or a reasoning item (dropped: see to_chat_request)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[ContentPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        kind = v.get("type", "message")
        if kind == "item_reference":
            raise _reject("item_reference needs stored responses; Orchard is stateless: send the item itself", "type")
        if isinstance(kind, str) and kind not in _ITEM_TYPES:
            raise _reject(
                f"'{kind}' items are not supported (built-in tools are not available); send messages, function_call and function_call_output items",
                "type",
            )
        v = dict(v)
        text_type = "output_text" if v.get("role") == "assistant" else "input_text"
        for key, kind_of_text in (("content", text_type), ("output", "input_text")):
            if isinstance(v.get(key), str):
                v[key] = [{"type": kind_of_text, "text": v[key]}]
        return v

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}
        for name in need.get(self.type, ()):
            if getattr(self, name) is None:
                raise _reject(f"a {self.type} item needs '{name}'", name, "missing_required_parameter")
        if self.type == "message":
            assert self.role is not None
            allowed = _PARTS_BY_ROLE[self.role]
            for j, part in enumerate(self.content or ()):
                if part.type not in allowed:
                    raise _reject(f"{self.role} messages take {' or '.join(allowed)} parts, not {part.type}", f"content[{j}].type", "invalid_value")
        for j, part in enumerate(self.output or ()):
            if part.type not in ("input_text", "input_image"):
                raise _reject(f"function_call_output takes input_text or input_image parts, not {part.type}", f"output[{j}].type", "invalid_value")
        return self


class FunctionTool(_Part):
    """A function tool (the Responses API's flat shape). Built-in tools run on OpenAI's side."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) and isinstance(v.get("type"), str) else None  # a list is unhashable
        if isinstance(kind, str) and kind != "function":
            raise _reject(f"built-in tools are not supported (type '{kind}'); define function tools", "type")
        return v


class TextFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        for name in ("name", "schema_") if self.type == "json_schema" else ():
            if getattr(self, name) is None:
                key = name.rstrip("_")
                raise _reject(f"a json_schema format needs '{key}'", key, "missing_required_parameter")
        return self


class TextConfig(_Part):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint; ignored


class ReasoningConfig(_Part):
    effort: str | None = None  # passed to the chat template as reasoning_effort
    summary: str | None = None  # ignored: the reasoning itself is returned, not a summary
    generate_summary: str | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    model: str = Field(min_length=1)
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # local-server extra (extra_body), as in chat
    stream: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None  # echoed in the Response
    # Accepted and ignored: hints, or stateful features that are off when ignored.
    store: bool | None = None
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Needs stored state or features Orchard lacks: a 400 when set.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return [{"type": "message", "role": "user", "content": v}] if isinstance(v, str) else v

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, v: Any) -> Any:
        if v is not None:
            raise _reject("Orchard does not store responses or conversations; send the whole conversation in 'input'", code="unsupported_parameter")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise _reject("background responses need stored responses; Orchard is stateless", code="unsupported_parameter")
        return v

    @field_validator("prompt")
    @classmethod
    def _no_prompt(cls, v: Any) -> Any:
        if v is not None:
            raise _reject("stored prompt templates are not supported; send instructions and input", code="unsupported_parameter")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _reject("logprobs are not available on /v1/responses; use /v1/chat/completions", code="unsupported_parameter")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        kind = v.get("type") if isinstance(v, dict) and isinstance(v.get("type"), str) else None  # a list is unhashable
        if kind == "function" and isinstance(v.get("name"), str):
            return {"type": "function", "name": v["name"]}
        if kind == "allowed_tools" and v.get("mode") in ("auto", "required") and isinstance(v.get("tools"), list):
            for j, tool in enumerate(v["tools"]):
                if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                    raise _reject("allowed_tools may list function tools only ({'type': 'function', 'name': ...})", f"tools[{j}]")
            return {"type": "allowed_tools", "mode": v["mode"], "tools": [{"type": "function", "name": t["name"]} for t in v["tools"]]}
        if isinstance(kind, str) and kind not in ("function", "allowed_tools"):
            raise _reject(f"tool_choice '{kind}' names a built-in tool; only function tools are supported", "type")
        raise _reject("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or allowed_tools", code="invalid_value")

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ResponsesRequest:
        names = {t.name for t in self.tools or ()}
        choice = self.tool_choice
        wanted = (
            [choice["name"]]
            if isinstance(choice, dict) and choice["type"] == "function"
            else [t["name"] for t in choice["tools"]]
            if isinstance(choice, dict)
            else []
        )
        for name in wanted:
            if name not in names:
                raise _reject(f"tool '{name}' is not in tools", "tool_choice", "invalid_value")
        if choice == "required" and not names:
            raise _reject("tool_choice 'required' needs tools", "tool_choice", "invalid_value")
        return self

    @property
    def ignored_fields(self) -> list[str]:
        """Keys of the body that no model here defines: ignored (the ingress may log them)."""
        return sorted(self.model_extra or ())


def parse_responses_request(body: Any) -> ResponsesRequest:
    """A /v1/responses request from JSON bytes / str or a dict; ProtocolError (400, OpenAI's body)."""
    return parse_body(ResponsesRequest, body)


# ---- translation to an OpenAI chat body ----------------------------------------------------------


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


# ---- responses ---------------------------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _usage(finish: Finish | None) -> dict[str, Any] | None:
    """OpenAI's Responses usage. input_tokens include cached ones (OpenAI counts them in). The
    engine does not count reasoning tokens apart, so reasoning_tokens is 0."""
    if finish is None:
        return None
    return {
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": finish.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


def finish_error(finish: Finish, statuses: Mapping[str, int] | None = None) -> ProtocolError | None:
    """The error a Finish reports (reason error / cancelled), or None."""
    if finish.reason == "cancelled":
        return ProtocolError(499, "cancelled", "the request was cancelled")
    if finish.reason != "error":
        return None
    code = finish.error_code or "internal"
    return ProtocolError((statuses or ENGINE_STATUS).get(code, 500), code, finish.error or "generation failed")


def _failure_code(status: int) -> str:
    """A Response's `error.code` (OpenAI's fixed list) for an HTTP status."""
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(status, "server_error")


def _sse(data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {data['type']}\ndata: {payload}\n\n".encode()


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


class ResponseStreamEncoder:
    """Output events of one generation -> the Responses SSE stream:

        response.created, response.in_progress,
        per output item: response.output_item.added,
          message:       content_part.added, output_text.delta*, output_text.done, content_part.done
          reasoning:     content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
          function_call: function_call_arguments.delta*, function_call_arguments.done
        response.output_item.done,
        response.completed (stop, tool calls) | response.incomplete (max_output_tokens)

    every event with its `sequence_number`. Items are numbered in order of appearance; a message
    or reasoning item closes when another item starts, a function_call at its ToolCallEnd, anything
    open at the Finish. An error (Finish reason "error", or `error()`) sends an `error` event (the
    engine's code) and response.failed (OpenAI's code list); "cancelled" sends nothing more.

        enc = ResponseStreamEncoder(req, response_id)
        yield enc.start()
        async for event in events: yield enc.feed(event)
        yield enc.close()
    """

    def __init__(
        self,
        req: ResponsesRequest,
        response_id: str,
        *,
        model: str | None = None,
        created_at: int | None = None,
        statuses: Mapping[str, int] | None = None,
    ):
        self.req = req
        self.response_id = response_id
        self.model = model or req.model
        self.created_at = int(time.time()) if created_at is None else created_at
        self.statuses = statuses
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.finish: Finish | None = None
        self.failure: dict[str, Any] | None = None
        self.started = False
        self.done = False
        self._open: dict[Any, int] = {}  # "message" / "reasoning" / ("tool", call index) -> output index
        self._sequence = 0
        self._base = response_id.removeprefix("resp_")

    # -- the Response object ---------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        """The Response as it stands (after a Finish: the whole response)."""
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None:
            text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        reason = self.finish.reason if self.finish else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.failure,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": _copy({"o": self.output})["o"],
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": _usage(self.finish) if self.status in ("completed", "incomplete") else None,
            "user": req.user,
            "metadata": dict(req.metadata or {}),
        }

    # -- building -------------------------------------------------------------------------------

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return [{"type": "response.created", "response": self.response()}, {"type": "response.in_progress", "response": self.response()}]

    def _add(self, key: Any, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output)
        self.output.append(item)
        self._open[key] = index
        return [{"type": "response.output_item.added", "output_index": index, "item": _copy(item)}]

    def _close(self, key: Any, status: str = "completed") -> list[dict[str, Any]]:
        index = self._open.pop(key, None)
        if index is None:
            return []
        item = self.output[index]
        item["status"] = status
        out: list[dict[str, Any]] = []
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            out.append({"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"], "logprobs": []})
            out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)})
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]})
            out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)})
        else:
            out.append({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
        out.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return out

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self._base}_{len(self.output)}"

    def _text(self, key: str, text: str) -> list[dict[str, Any]]:
        other = "reasoning" if key == "message" else "message"
        out = self._close(other)
        if key not in self._open:
            part: dict[str, Any]
            item: dict[str, Any]
            if key == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": self._item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"id": self._item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            out += self._add(key, item)
            item["content"].append(part)
            out.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": self._open[key],
                    "content_index": 0,
                    "part": _copy(part),
                }
            )
        index = self._open[key]
        item = self.output[index]
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
        if key == "message":
            out.append({"type": "response.output_text.delta", **where, "logprobs": []})
        else:
            out.append({"type": "response.reasoning_text.delta", **where})
        return out

    def _fail(self, status: int, message: str, code: str | None) -> list[dict[str, Any]]:
        self.done = True
        self.status = "failed"
        for key in list(self._open):
            self.output[self._open.pop(key)]["status"] = "incomplete"
        self.failure = {"code": _failure_code(status), "message": message, "type": error_type(status, code)}
        return [
            {"type": "error", "code": code, "message": message, "param": None},
            {"type": "response.failed", "response": self.response()},
        ]

    def _events(self, event: OutputEvent) -> list[dict[str, Any]]:
        if isinstance(event, Finish) and event.reason == "cancelled":
            self.finish, self.done = event, True  # the client is gone: nothing more to send
            return []
        out = self._start()
        if isinstance(event, TextDelta | ReasoningDelta):
            if event.text:
                out += self._text("message" if isinstance(event, TextDelta) else "reasoning", event.text)
        elif isinstance(event, ToolCallStart):
            out += self._close("message") + self._close("reasoning") + self._close(("tool", event.index))
            out += self._add(
                ("tool", event.index),
                {
                    "id": self._item_id("fc"),
                    "type": "function_call",
                    "call_id": event.id,
                    "name": event.name,
                    "arguments": "",
                    "status": "in_progress",
                },
            )
        elif isinstance(event, ToolCallArguments):
            index = self._open.get(("tool", event.index))
            if index is not None and event.arguments:
                item = self.output[index]
                item["arguments"] += event.arguments
                out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index, "delta": event.arguments})
        elif isinstance(event, ToolCallEnd):
            out += self._close(("tool", event.index))
        elif isinstance(event, Finish):
            self.finish = event
            error = finish_error(event, self.statuses)
            if error is not None:
                return out + self._fail(error.status, error.message, error.code)
            status = "incomplete" if event.reason == "length" else "completed"
            for key in sorted(self._open, key=self._open.__getitem__):
                out += self._close(key, status)
            self.status = status
            self.done = True
            out.append({"type": f"response.{status}", "response": self.response()})
        return out

    def _encode(self, events: list[dict[str, Any]]) -> bytes:
        chunks = []
        for e in events:
            chunks.append(_sse({**e, "sequence_number": self._sequence}))
            self._sequence += 1
        return b"".join(chunks)

    # -- the stream ------------------------------------------------------------------------------

    def start(self) -> bytes:
        """response.created and response.in_progress now (before the first token), if not sent yet."""
        return b"" if self.done else self._encode(self._start())

    def feed(self, event: OutputEvent) -> bytes:
        return b"" if self.done else self._encode(self._events(event))

    def error(self, status: int, message: str, code: str | None = None) -> bytes:
        """Error events for a failure outside the output events (the model actor died, ...)."""
        if self.done:
            return b""
        return self._encode(self._start() + self._fail(status, message, code))

    def close(self) -> bytes:
        return self.error(500, "the stream ended without a finish reason", "internal")


def response_object(
    req: ResponsesRequest,
    response_id: str,
    events: Iterable[OutputEvent],
    *,
    model: str | None = None,
    created_at: int | None = None,
    statuses: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The Response for a whole generation (non-streaming): status completed, or incomplete with
    incomplete_details.reason max_output_tokens. An error / cancelled Finish raises its
    ProtocolError (OpenAI's error body), as does a generation without a Finish."""
    enc = ResponseStreamEncoder(req, response_id, model=model, created_at=created_at, statuses=statuses)
    for event in events:
        enc._events(event)
    if enc.finish is None:
        raise ProtocolError(500, "internal", "generation ended without a finish reason")
    error = finish_error(enc.finish, statuses)
    if error is not None:
        raise error
    return enc.response()
