"""The Responses API's request body (POST /v1/responses): input items, content parts, function tools,
text format and reasoning config. `store` and `previous_response_id` are honoured by the route
(router/protocols/responses/state.py, store.py); what needs state Orchard does not keep
(conversations, item references, background responses, stored prompts) is a 400 here.

Field policy follows router.protocols.openai (the chat endpoint): documented fields that do not
change the output (user, metadata, include, truncation, service_tier, prompt_cache_key, ...) are
accepted and ignored, as are keys OpenAI does not document (`ignored_fields`); `top_k` is the one
local-server extra honoured. `namespace` tools are flattened to the function and custom tools they
hold; `custom` (freeform) tools are offered to the model as a function of one string (`input`) and
answered as `custom_tool_call` items; hosted tools the server cannot run (web search, file search,
computer use, MCP, ...) are left out of the model's tools (`dropped_tools`: the route says so in a
header). Input files / audio are a 400. Errors use OpenAI's body (router.protocols.openai.error_body) with
OpenAI's param spelling (`input[2].content[0].image_url`)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.protocols.openai import object_schema_error, parse_body, reject as _reject


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
_ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning")


class InputItem(_Part):
    """One item of `input`: a message (EasyInputMessage: no `type` needed), a function_call the
    model made, a function_call_output, or a reasoning item (dropped: see to_chat_request)."""

    type: str = "message"
    id: str | None = None  # kept in the stored conversation (input_items), else one is made
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a function_call of a namespace tool's function
    arguments: str | None = None
    input: str | None = None  # a custom_tool_call's freeform input
    output: list[ContentPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        kind = v.get("type", "message")
        if kind == "item_reference":
            raise _reject("item_reference is not supported: send the item itself, or continue a stored response with previous_response_id", "type")
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
        need = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "custom_tool_call": ("call_id", "name", "input"),
            "custom_tool_call_output": ("call_id", "output"),
        }
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
                raise _reject(f"{self.type} takes input_text or input_image parts, not {part.type}", f"output[{j}].type", "invalid_value")
        return self


_NAME = r"^[A-Za-z0-9_.\-]+$"  # as chat's FunctionDefinition
# A custom (freeform) tool as the model sees it: a function of one string.
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


class Tool(_Part):
    """One entry of `tools`: a `function`, a `custom` (freeform) tool, a `namespace` of those, or a
    hosted tool (any other type: web_search, file_search, ...), which the request keeps only to
    echo it and to say it was left out (its type goes back in a response header: a name, not text)."""

    type: str = Field(min_length=1, max_length=64, pattern=_NAME)
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: Any = None  # a custom tool's input grammar: the model is not held to it
    tools: list[Tool] | None = None  # a namespace's functions and custom tools

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        error = object_schema_error(v)
        if error is not None:
            raise _reject(error, code="invalid_value")
        return v

    @model_validator(mode="after")
    def _complete(self) -> Tool:
        if self.type in ("function", "custom", "namespace") and self.name is None:
            raise _reject(f"a {self.type} tool needs 'name'", "name", "missing_required_parameter")
        if self.type == "namespace":
            if not self.tools:
                raise _reject("a namespace tool needs 'tools'", "tools", "missing_required_parameter")
            for j, inner in enumerate(self.tools):
                if inner.type not in ("function", "custom"):
                    raise _reject(f"a namespace holds function and custom tools, not {inner.type}", f"tools[{j}].type", "invalid_value")
        return self


class FunctionTool(BaseModel):
    """A tool as the model is offered it: a function (a namespace's function flattened, named as
    `name` unless that name is taken, then `<namespace>.<name>`), or a custom tool's function of
    one string (`custom`)."""

    model_config = ConfigDict(frozen=True)

    name: str  # the name the model sees and calls
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    custom: bool = False
    namespace: str | None = None
    tool_name: str  # the name the client knows it by (within its namespace)


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
    tools: list[Tool] | None = None
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
    store: bool | None = None  # None: true, as OpenAI's default (the route stores the response)
    previous_response_id: str | None = Field(default=None, min_length=1)  # the route continues its conversation
    # Accepted and ignored: hints.
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
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return [{"type": "message", "role": "user", "content": v}] if isinstance(v, str) else v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise _reject(
                "the Conversations API is not supported; continue a stored response with previous_response_id, or send the whole conversation in 'input'",
                code="unsupported_parameter",
            )
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise _reject("background responses are not supported; stream the response instead", code="unsupported_parameter")
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
        if kind in ("function", "custom") and isinstance(v.get("name"), str):
            return {"type": "function", "name": v["name"]}
        if kind == "allowed_tools" and v.get("mode") in ("auto", "required") and isinstance(v.get("tools"), list):
            for j, tool in enumerate(v["tools"]):
                if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom") or not isinstance(tool.get("name"), str):
                    raise _reject("allowed_tools may list function and custom tools only ({'type': 'function', 'name': ...})", f"tools[{j}]")
            return {"type": "allowed_tools", "mode": v["mode"], "tools": [{"type": "function", "name": t["name"]} for t in v["tools"]]}
        if isinstance(kind, str) and kind not in ("function", "custom", "allowed_tools"):
            raise _reject(f"tool_choice '{kind}' names a built-in tool; only function tools are supported", "type")
        raise _reject("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or allowed_tools", code="invalid_value")

    @model_validator(mode="after")
    def _something_to_answer(self) -> ResponsesRequest:
        if self.instructions is None and all(item.type == "reasoning" for item in self.input):
            raise _reject("input has only reasoning items: send a message or a function_call_output", "input", "invalid_value")
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        """The tools the model is offered: functions and custom tools, a namespace's flattened.
        A flattened name that another tool (top-level or in another namespace) has too is
        `<namespace>.<name>`."""
        flat: list[tuple[Tool, str | None]] = []
        for tool in self.tools or ():
            if tool.type in ("function", "custom"):
                flat.append((tool, None))
            elif tool.type == "namespace":
                flat += [(inner, tool.name) for inner in tool.tools or ()]
        seen = Counter(t.name for t, _ in flat)
        out = []
        for tool, ns in flat:
            assert tool.name is not None
            name = f"{ns}.{tool.name}" if ns is not None and seen[tool.name] > 1 else tool.name
            custom = tool.type == "custom"
            out.append(
                FunctionTool(
                    name=name,
                    description=tool.description,
                    parameters=CUSTOM_PARAMETERS if custom else tool.parameters,
                    strict=tool.strict,
                    custom=custom,
                    namespace=ns,
                    tool_name=tool.name,
                )
            )
        return out

    @property
    def dropped_tools(self) -> list[str]:
        """The hosted tools (by type) left out of the model's tools: the server cannot run them."""
        return list(dict.fromkeys(t.type for t in self.tools or () if t.type not in ("function", "custom", "namespace")))

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ResponsesRequest:
        tools = [t.name for t in self.function_tools]
        if len(set(tools)) != len(tools):
            raise _reject("tool names must be unique", "tools", "invalid_value")
        names = set(tools) | {t.tool_name for t in self.function_tools}
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
        if isinstance(choice, dict) and choice["type"] == "allowed_tools" and choice["mode"] == "required" and not wanted:
            raise _reject("allowed_tools in mode 'required' needs at least one tool", "tool_choice", "invalid_value")
        return self

    @property
    def ignored_fields(self) -> list[str]:
        """Keys of the body that no model here defines: ignored (the ingress may log them)."""
        return sorted(self.model_extra or ())


def parse_responses_request(body: Any) -> ResponsesRequest:
    """A /v1/responses request from JSON bytes / str or a dict; ProtocolError (400, OpenAI's body)."""
    return parse_body(ResponsesRequest, body)
