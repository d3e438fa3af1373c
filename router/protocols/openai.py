"""OpenAI's wire format for Orchard: request models, their translation to engine requests, and the
response / SSE shapes built from the engine's Delta dicts. Pure (pydantic + stdlib): no Ray, no MLX,
no web framework, so the ingress stays thin and everything here is tested without a cluster.

Requests accept OpenAI's whole documented field set for chat completions, completions and
embeddings, because real clients (the openai SDK, LangChain, editors) send fields such as `user`,
`store`, `metadata` or `stream_options` whatever the server. A field Orchard cannot honour (n > 1,
deprecated `functions`, audio, best_of > 1, echo, suffix, ...) is a 400 that names it in
`param`: silently ignoring it would change what the client gets back. Fields that are hints only
(`user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`, `prediction`, `verbosity`,
`parallel_tool_calls`, ...) are accepted and ignored. Keys that OpenAI does not document at all are
ignored too (listed by `ignored_fields`), as local servers do, except the common local-server
sampling extras `top_k`, `min_p`, `repetition_penalty` and `chat_template_kwargs`, which are honoured.

Error `param` paths follow OpenAI's spelling: dotted names with bracketed indices
(`messages[0].content[1].image_url.url`)."""

from __future__ import annotations

import base64
import json
import math
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from router.errors import STATUS, OrchardError

if TYPE_CHECKING:  # the engine module imports MLX; the router must not need it to parse requests
    from deployments.engines.llm import GenerationRequest

DEFAULT_MAX_TOKENS = 512  # OpenAI's chat default is "up to the context"; a bound keeps a slot from running away
MAX_STOP = 8  # OpenAI allows 4; the engine takes 8
MAX_TOP_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of (near) zero probability; JSON has no -inf

SSE_DONE = b"data: [DONE]\n\n"

# The status of each error code: the one table (router/errors.py).
ENGINE_STATUS = STATUS


# ---- errors ------------------------------------------------------------------------------------


def error_type(status: int, code: str | None = None) -> str:
    """OpenAI's error `type` for a status. OpenAI answers an unknown model (and every other 404 it
    returns) with invalid_request_error and code model_not_found, so 404 follows it."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 409:
        return "conflict_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        busy = code is not None and ("busy" in code or "overloaded" in code)
        return "overloaded_error" if busy else "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, code: str | None, message: str, param: str | None = None, type: str | None = None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type or error_type(status, code), "param": param, "code": code}}


class ProtocolError(OrchardError):
    """A wire error of a protocol's own: an OrchardError whose status the protocol decides (a bad
    body is a 400 whatever field it names), with OpenAI's error `type` when it is not the status's."""

    def __init__(self, status: int, code: str | None, message: str, param: str | None = None, type: str | None = None):
        super().__init__(code or "invalid_request", message, param, status=status)
        self.type = type

    def __reduce__(self):
        return (type(self), (self.status, self.code, self.message, self.param, self.type))

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param, self.type)


class UnsupportedParameter(ProtocolError):
    """A 400 for a parsed request the chosen engine cannot serve (image parts for a text model,
    sampling controls a VLM lacks), raised by the translation functions."""

    def __init__(self, message: str, param: str | None, code: str = "unsupported_value"):
        super().__init__(400, code, message, param)


def reject(message: str, at: str | None = None, code: str = "unsupported_value") -> PydanticCustomError:
    """A validation error whose message is ours, for a field the protocol defines but Orchard cannot
    honour (raise it in a validator). `at` extends the error's location (a model validator's
    location is its model, not the field). Every protocol's `validation_error` reads code and at."""
    return PydanticCustomError("orchard", message, {"code": code, "at": at})


_unsupported = reject


def _invalid(message: str, at: str | None = None, code: str = "invalid_value") -> PydanticCustomError:
    return reject(message, at, code)


def param_path(loc: Iterable[Any]) -> str | None:
    """('messages', 0, 'content', 1, 'type') -> 'messages[0].content[1].type'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith("["):
            out += part
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _join_path(base: str | None, at: str | None) -> str | None:
    if not at:
        return base
    if not base:
        return at
    return base + at if at.startswith("[") else f"{base}.{at}"


def validation_error(error: ValidationError | Sequence[Mapping[str, Any]]) -> ProtocolError:
    """Pydantic errors (a ValidationError, or FastAPI's RequestValidationError.errors(), whose
    locations start with "body") -> one OpenAI 400 naming the first bad field; the rest are counted
    in the message (OpenAI reports one error at a time too)."""
    errors = error.errors() if isinstance(error, ValidationError) else list(error)
    if not errors:
        return ProtocolError(400, "invalid_request", "invalid request")
    first = errors[0]
    loc = list(first.get("loc") or ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    ctx = first.get("ctx") or {}
    kind = str(first.get("type") or "")
    msg = str(first.get("msg") or "invalid value").removeprefix("Value error, ")
    if kind == "orchard":
        code = ctx.get("code") or "invalid_value"
        param = _join_path(param_path(loc), ctx.get("at"))
    else:
        param = param_path(loc)
        if kind == "missing":
            code = "missing_required_parameter"
        elif kind.endswith("_type") or kind.endswith("_parsing"):
            code = "invalid_type"
        else:
            code = "invalid_value"
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "The request body must be a JSON object."
    elif param is None:
        message = msg
    elif code == "missing_required_parameter":
        message = f"Missing required parameter: '{param}'."
    elif code == "invalid_type":
        message = f"Invalid type for '{param}': {msg}"
    elif code == "unsupported_parameter":
        message = f"Unsupported parameter: '{param}': {msg}"
    elif code == "unsupported_value":
        message = f"Unsupported value for '{param}': {msg}"
    else:
        message = f"Invalid value for '{param}': {msg}"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request)"
    return ProtocolError(400, code, message, param)


def validation_error_body(error: ValidationError | Sequence[Mapping[str, Any]]) -> dict:
    """The OpenAI 400 body for pydantic errors (see `validation_error`)."""
    return validation_error(error).body()


# ---- request models ------------------------------------------------------------------------------


class _Part(BaseModel):
    """Nested objects: unknown keys ignored (they never change what Orchard does)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ImageURL(_Part):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Part):
    """One part of a message's content. One model for every part type (not a union) so a bad part
    is reported at its own path, not under a pydantic union tag."""

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    refusal: str | None = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_string(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v  # some clients send the URL bare

    @model_validator(mode="after")
    def _payload(self) -> ContentPart:
        if self.type == "input_audio":
            raise _unsupported("audio input is not supported", at="type")
        if self.type == "file":
            raise _unsupported("file inputs are not supported", at="type")
        if getattr(self, self.type) is None:
            raise _invalid(f"a {self.type} part needs a '{self.type}' field", at=self.type, code="missing_required_parameter")
        return self


_PARTS_BY_ROLE = {
    "system": ("text",),
    "developer": ("text",),
    "tool": ("text",),
    "user": ("text", "image_url"),
    "assistant": ("text", "refusal"),
}


class ChatMessage(_Part):
    """A chat message. `content` is kept as a list of parts (a string becomes one text part)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role tool (not required: a template that ignores it loses nothing)
    tool_calls: list[dict[str, Any]] | None = None  # assistant history; passed to the chat template
    function_call: dict[str, Any] | None = None  # deprecated; ignored
    refusal: str | None = None  # assistant history; ignored
    audio: dict[str, Any] | None = None  # assistant audio reference: unsupported

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, list):
            return v
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        raise _invalid("content must be a string or an array of content parts", code="invalid_type")

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.audio is not None:
            raise _unsupported("audio messages are not supported", at="audio", code="unsupported_parameter")
        if self.content is None:
            if self.role != "assistant":
                raise _invalid(f"a {self.role} message needs content", at="content", code="missing_required_parameter")
            return self
        allowed = _PARTS_BY_ROLE[self.role]
        for j, part in enumerate(self.content):
            if part.type not in allowed:
                raise _invalid(f"{self.role} messages take {' or '.join(allowed)} parts, not {part.type}", at=f"content[{j}].type")
        return self

    def text(self) -> str:
        """The text parts joined by newlines (as vLLM does: parts are usually separate passages)."""
        # the part validator (_payload) guarantees the field its type names
        return "\n".join(p.text if p.type == "text" else p.refusal for p in self.content or () if p.type in ("text", "refusal"))  # type: ignore[misc]

    def has_images(self) -> bool:
        return any(p.type == "image_url" for p in self.content or ())


class StreamOptions(_Part):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class JSONSchemaFormat(_Part):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    """text, json_object or json_schema: the JSON ones are enforced while decoding (a grammar inside
    the batched engine), so the output always parses and, for json_schema, validates."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _invalid(
                "response_format json_schema needs a 'json_schema' object with a 'schema'", at="json_schema", code="missing_required_parameter"
            )
        return self

    def constraint(self) -> dict[str, Any] | None:
        """The engine's Constraint (deployments.engines.constrained) as a dict, or None for text."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema" and (schema := self.json_schema) is not None:  # not None: _schema_given
            return {"type": "json_schema", "schema": schema.schema_, "strict": bool(schema.strict)}
        return None


class FunctionDefinition(_Part):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI tool dict chat templates take (parameters default to an empty object schema)."""
        f = self.function
        out = {"name": f.name, "parameters": f.parameters if f.parameters is not None else {"type": "object", "properties": {}}}
        if f.description is not None:
            out["description"] = f.description
        return {"type": "function", "function": out}


def _normalise_stop(v: Any) -> Any:
    """str | list[str] -> list[str] without empty strings (an empty stop string would end every
    completion at once; no client means that)."""
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _invalid("stop must be a string or an array of strings", code="invalid_type")
    v = [s for s in v if s]
    if len(v) > MAX_STOP:
        raise _invalid(f"at most {MAX_STOP} stop sequences, got {len(v)}")
    return v


def _normalise_logit_bias(v: Any) -> Any:
    """{"50256": -100} -> {50256: -100.0}: token ids as JSON object keys, biases in [-100, 100]."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _invalid("logit_bias must be an object mapping token ids to biases", code="invalid_type")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or isinstance(key, bool):
            raise _invalid(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", at=str(key))
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise _invalid("logit_bias values must be numbers in [-100, 100]", at=str(key))
        out[token] = float(bias)
    return out


class _Request(BaseModel):
    """Top level of a request: undocumented keys are kept aside (see `ignored_fields`), not used."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)

    @property
    def ignored_fields(self) -> list[str]:
        """Keys of the body that no model here defines: ignored (the ingress may log them)."""
        return sorted(self.model_extra or ())


class _Sampling(_Request):
    """Fields shared by chat completions and completions, plus the local-server sampling extras."""

    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None
    # Local-server extras (vLLM, llama.cpp, LM Studio): honoured.
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return _normalise_stop(v)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        return _normalise_logit_bias(v)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise _unsupported("Orchard returns one choice per request; n must be 1")
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # False: a forced call is exactly one call
    functions: list[dict[str, Any]] | None = None  # deprecated tools
    function_call: Any = None
    response_format: ResponseFormat | None = None
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # passed to the chat template (gpt-oss style templates read it)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: variables for the chat template
    # Hints, accepted and ignored: they do not change the completion.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if v not in (None, [], "none", "auto"):
            raise _unsupported("the deprecated functions API is not supported; use tools and tool_choice", code="unsupported_parameter")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v in (None, "none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) and isinstance(v["function"].get("name"), str):
            return {"type": "function", "function": {"name": v["function"]["name"]}}
        raise _invalid("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if isinstance(self.tool_choice, dict) and self.tool_choice["function"]["name"] not in names:
            raise _invalid(f"tool_choice names {self.tool_choice['function']['name']!r}, which is not in tools", at="tool_choice")
        if self.tool_choice == "required" and not names:
            raise _invalid("tool_choice 'required' needs tools", at="tool_choice")
        if len(set(names)) != len(names):
            raise _invalid("tool names must be unique", at="tools")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether the model is offered tools (and its output parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """'required', a function name, or None when the model may answer in text."""
        if not self.uses_tools or self.tool_choice in (None, "auto"):
            return None
        return "required" if self.tool_choice == "required" else self.tool_choice["function"]["name"]

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: Any) -> Any:
        if v is not None:
            raise _unsupported("audio output is not supported", code="unsupported_parameter")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v and "audio" in v:
            raise _unsupported("only the text modality is supported")
        return v

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, v: Any) -> Any:
        if v is not None:
            raise _unsupported("web search is not supported", code="unsupported_parameter")
        return v

    @model_validator(mode="after")
    def _logprobs_pair(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs needs logprobs set to true", at="top_logprobs")
        return self

    def has_images(self) -> bool:
        """Whether any message carries an image part (only a VLM model can serve it)."""
        return any(m.has_images() for m in self.messages)


class CompletionRequest(_Sampling):
    """POST /v1/completions (legacy). One prompt: a string, a list of one string, token ids, or a
    list of one token-id list."""

    prompt: str | list[int]
    best_of: int | None = Field(default=None, ge=1)
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI caps it at 5
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise _invalid("prompt must be a string, an array of one string, or an array of token ids", code="invalid_type")
        if all(isinstance(x, list) for x in v) or all(isinstance(x, str) for x in v):
            if len(v) != 1:
                raise _unsupported(f"one prompt per request, got {len(v)}")
            v = v[0]
            if isinstance(v, str):
                return v
            if not v:
                raise _invalid("a token-id prompt must not be empty")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise _invalid("prompt must be a string, an array of one string, or an array of token ids (non-negative integers)")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise _unsupported("best_of must be 1")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("suffix (insertion) is not supported", code="unsupported_parameter")
        return v


class EmbeddingRequest(_Request):
    """POST /v1/embeddings. `input` is normalised to a list of non-empty strings."""

    input: list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str]:
        return list(self.input)

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not v:
            raise _invalid("input must be a non-empty string or array of strings", code="invalid_type")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v) or all(isinstance(x, list) for x in v):
            raise _unsupported("token-id input is not supported; send text")
        for i, x in enumerate(v):
            if not isinstance(x, str):
                raise _invalid("input must be a string or an array of strings", at=f"[{i}]", code="invalid_type")
            if not x:
                raise _invalid("input strings must not be empty", at=f"[{i}]")
        return v


def parse_body(cls: type[BaseModel], body: Any, to_error: Callable[[ValidationError], ProtocolError] | None = None) -> Any:
    """`cls` from JSON bytes / str or a decoded dict; ProtocolError (400) if it is bad, built by
    `to_error` (default: OpenAI's spelling of the failing path) for a field that fails validation.
    Every protocol's parser goes through here."""
    if isinstance(body, bytes | bytearray | str):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ProtocolError(400, "invalid_json", "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise ProtocolError(400, "invalid_type", "The request body must be a JSON object.")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise (to_error or validation_error)(e) from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """A chat request from JSON bytes / str or a decoded dict; ProtocolError (400) if it is bad."""
    return parse_body(ChatCompletionRequest, body)


def parse_completion_request(body: Any) -> CompletionRequest:
    return parse_body(CompletionRequest, body)


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    return parse_body(EmbeddingRequest, body)


# ---- translation to engine requests -------------------------------------------------------------


_ENGINE_ROLE = {"developer": "system"}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages for a text model's chat template: role ('developer' -> 'system') and string content
    (text parts joined); name / tool_call_id / tool_calls pass through. Image parts are a 400 here:
    a text model cannot see them (route the request to a VLM with `split_images`)."""
    out = []
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content or ()):
            if part.type == "image_url":
                raise UnsupportedParameter("this model does not accept images; use a vision model", f"messages[{i}].content[{j}]")
        msg: dict[str, Any] = {"role": _ENGINE_ROLE.get(m.role, m.role), "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        out.append(msg)
    return out


def split_images(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """(messages, images) for the VLM engine: each image part becomes {"type": "image"} in place,
    its URL (data: URL or allowed path) goes to `images` in order; text parts stay text parts."""
    messages, images = [], []
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            raise UnsupportedParameter("vision models do not take tool messages", f"messages[{i}].role")
        parts = []
        for p in m.content or ():
            if p.type == "image_url":
                parts.append({"type": "image"})
                images.append(p.image_url.url)  # type: ignore[union-attr]  # an image_url part has one (_payload)
            else:
                parts.append({"type": "text", "text": p.text if p.type == "text" else p.refusal})  # type: ignore[dict-item]
        messages.append({"role": _ENGINE_ROLE.get(m.role, m.role), "content": parts})
    return messages, images


def check_image_urls(req: ChatCompletionRequest, allow_remote: bool) -> None:
    """Image parts must be data: URLs, or http(s) URLs when the operator lets the server fetch
    them (`allow_remote_images`); anything else (a file path, another scheme) is a 400 naming it."""
    schemes = ("data:", "http://", "https://") if allow_remote else ("data:",)
    allowed = "a data: URL or an http(s) URL" if allow_remote else "a data: URL (this server does not fetch remote images)"
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content or ()):
            if part.type == "image_url" and not part.image_url.url.startswith(schemes):  # type: ignore[union-attr]
                raise ProtocolError(400, "invalid_image_url", f"an image must be {allowed}", f"messages[{i}].content[{j}].image_url.url")


def _sampling(req: _Sampling) -> dict[str, Any]:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0:  # OpenAI accepts 0: the limit of nucleus sampling is greedy decoding
        temperature, top_p = 0.0, 1.0
    return {"temperature": temperature, "top_p": top_p, "stop": list(req.stop or [])}


def generation_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The fields of a GenerationRequest, as a plain dict (what crosses to the model actor; the
    actor validates it). max_tokens: max_completion_tokens, else max_tokens, else 512; temperature
    1.0 and top_p 1.0 as OpenAI."""
    out: dict[str, Any] = {}
    if isinstance(req, ChatCompletionRequest):
        out["messages"] = chat_messages(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        out["logprobs"] = bool(req.logprobs)
        out["top_logprobs"] = (req.top_logprobs or 0) if req.logprobs else 0
        template = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            template.setdefault("reasoning_effort", req.reasoning_effort)
        if template:
            out["chat_template_kwargs"] = template
        if req.tools:  # with tool_choice "none" too: the tools stay in the prompt, calls are not parsed
            out["tools"] = [t.as_dict() for t in req.tools]
        if req.response_format is not None and req.response_format.constraint() is not None:
            out["constraint"] = req.response_format.constraint()
    else:
        out["prompt" if isinstance(req.prompt, str) else "prompt_tokens"] = req.prompt
        max_tokens = req.max_tokens
        out["logprobs"] = req.logprobs is not None
        out["top_logprobs"] = req.logprobs or 0
    out["max_tokens"] = max_tokens or DEFAULT_MAX_TOKENS
    out.update(_sampling(req))
    out["top_k"] = max(0, req.top_k or 0)
    out["min_p"] = req.min_p or 0.0
    out["seed"] = req.seed
    out["presence_penalty"] = req.presence_penalty or 0.0
    out["frequency_penalty"] = req.frequency_penalty or 0.0
    out["repetition_penalty"] = req.repetition_penalty
    out["logit_bias"] = req.logit_bias or None
    return out


def to_generation_request(req: ChatCompletionRequest | CompletionRequest) -> GenerationRequest:
    """The engine's GenerationRequest (imports the LLM engine module, hence MLX, on first use; the
    ingress can send `generation_fields(req)` instead, which the model actor validates the same)."""
    from deployments.engines.llm import GenerationRequest

    return GenerationRequest(**generation_fields(req))


def to_vlm_request(req: ChatCompletionRequest) -> dict[str, Any]:
    """The model actor's VLM request dict (messages, images, max_tokens, temperature, top_p, stop).
    Sampling controls the VLM engine lacks are a 400 when set, never dropped silently."""
    used = {
        "logprobs": bool(req.logprobs),
        "seed": req.seed is not None,
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "logit_bias": bool(req.logit_bias),
        "top_k": bool(req.top_k and req.top_k > 0),
        "min_p": bool(req.min_p),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "chat_template_kwargs": bool(req.chat_template_kwargs),
        "tools": bool(req.tools),
        "response_format": req.response_format is not None and req.response_format.type != "text",
    }
    bad = next((name for name, on in used.items() if on), None)
    if bad is not None:
        raise UnsupportedParameter(f"vision models do not support '{bad}'", bad, "unsupported_parameter")
    messages, images = split_images(req)
    return {"messages": messages, "images": images, "max_tokens": req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS, **_sampling(req)}


# ---- responses ---------------------------------------------------------------------------------


def new_request_id(kind: Literal["chat", "completion", "embedding"] = "chat") -> str:
    prefix = {"chat": "chatcmpl", "completion": "cmpl", "embedding": "embd"}[kind]
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: Unix seconds."""
    return int(time.time())


def _as_dict(delta: Any) -> dict[str, Any]:
    """A Delta dict as the actor streams it, or a Delta / VLMDelta model."""
    return delta.model_dump() if hasattr(delta, "model_dump") else dict(delta)


def join_deltas(deltas: Iterable[Any]) -> dict[str, Any]:
    """A whole stream as one delta dict: text, token ids and logprobs joined; finish_reason, usage
    and error from the last delta that has them (for a non-streaming response)."""
    text: list[str] = []
    tokens: list[int] = []
    logprobs: list[Any] = []
    seen_logprobs = False
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    last: dict[str, Any] = {}
    for delta in deltas:
        d = _as_dict(delta)
        text.append(d.get("text") or "")
        reasoning.append(d.get("reasoning") or "")
        for part in d.get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            call["function"]["name"] += (part.get("function") or {}).get("name") or ""
            call["function"]["arguments"] += (part.get("function") or {}).get("arguments") or ""
        tokens.extend(d.get("token_ids") or ())
        if d.get("logprobs") is not None:
            seen_logprobs = True
            logprobs.extend(d["logprobs"])
        for key in ("finish_reason", "usage", "error", "error_code"):
            if d.get(key) is not None:
                last[key] = d[key]
    return {
        "text": "".join(text),
        "token_ids": tokens,
        "logprobs": logprobs if seen_logprobs else None,
        "finish_reason": last.get("finish_reason"),
        "usage": last.get("usage"),
        "error": last.get("error"),
        "error_code": last.get("error_code"),
        "reasoning": "".join(reasoning) or None,
        "tool_calls": [calls[i] for i in sorted(calls)] or None,
    }


def with_events(delta: Any, events: Iterable[Any]) -> dict[str, Any]:
    """An engine delta rewritten by what the output parser made of it (router.serving.output.parsing):
    `text` is the visible answer only, `reasoning` the text between reasoning markers,
    `tool_calls` OpenAI's streamed tool-call pieces, and finish_reason "tool_calls" when the answer
    was calls. Logprobs and usage stay as the engine sent them."""
    d = _as_dict(delta)
    text, reasoning, calls = [], [], []
    for e in events:
        if e.type == "text":
            text.append(e.text)
        elif e.type == "reasoning":
            reasoning.append(e.text)
        elif e.type == "tool_call_start":
            calls.append({"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif e.type == "tool_call_arguments":
            calls.append({"index": e.index, "function": {"arguments": e.arguments}})
        elif e.type == "finish" and e.reason == "tool_calls":
            d["finish_reason"] = "tool_calls"
    d["text"] = "".join(text)
    d["reasoning"] = "".join(reasoning) or None
    d["tool_calls"] = _merge_call_pieces(calls) or None
    return d


def _merge_call_pieces(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive pieces of one call in one chunk become one piece (fewer, bigger SSE deltas)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if out and out[-1]["index"] == p["index"]:
            out[-1]["function"]["arguments"] += p["function"]["arguments"]
        else:
            out.append({**p, "function": dict(p["function"])})
    return out


def _status(code: str | None, statuses: Mapping[str, int] | None) -> int:
    return (statuses or ENGINE_STATUS).get(code or "internal", 500)


def error_from_delta(delta: Any, statuses: Mapping[str, int] | None = None) -> ProtocolError | None:
    """The error a final delta reports (finish_reason "error"), or None. `statuses` maps engine
    codes to HTTP statuses (default ENGINE_STATUS, deployments.engine.HTTP_STATUS)."""
    d = _as_dict(delta)
    if d.get("finish_reason") != "error" and d.get("error_code") is None:
        return None
    code = d.get("error_code") or "internal"
    return ProtocolError(_status(code, statuses), code, d.get("error") or "generation failed")


def _finished(d: dict[str, Any], statuses: Mapping[str, int] | None) -> str:
    """The finish_reason of a complete (non-streamed) result; anything but stop / length /
    tool_calls raises."""
    error = error_from_delta(d, statuses)
    if error is not None:
        raise error
    reason = d.get("finish_reason")
    if reason == "cancelled":
        raise ProtocolError(499, "cancelled", "the request was cancelled")
    if reason not in ("stop", "length", "tool_calls"):
        raise ProtocolError(500, "internal", "generation ended without a finish reason")
    return reason


def usage_dict(usage: Any) -> dict[str, Any] | None:
    """Engine Usage (dict or model; a VLM's has no cached_tokens) -> OpenAI's usage object."""
    if usage is None:
        return None
    u = _as_dict(usage)
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)},
    }


def _logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def _entry(lp: Any) -> tuple[str, float, list[tuple[str, float]]]:
    """A TokenLogprob (dict or model; `top` items as (id, token, logprob) tuples or lists)."""
    d = _as_dict(lp)
    top = [(str(t[1]), _logprob(float(t[2]))) for t in d.get("top") or ()]
    return str(d["token"]), _logprob(float(d["logprob"])), top


def chat_logprobs(logprobs: Iterable[Any] | None) -> dict[str, Any] | None:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    if logprobs is None:
        return None
    content = []
    for lp in logprobs:
        token, value, top = _entry(lp)
        content.append(
            {
                "token": token,
                "logprob": value,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Iterable[Any] | None, text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs ({token: logprob} per token;
    tokens that decode alike keep the higher value) and text_offset (character offsets, counted
    from `text_offset` by the tokens' own text)."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    at = text_offset
    for lp in logprobs:
        token, value, top = _entry(lp)
        tokens.append(token)
        values.append(value)
        table: dict[str, float] = {}
        for t, v in top:
            table[t] = max(v, table.get(t, MIN_LOGPROB))
        tops.append(table)
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_completion_response(model: str, request_id: str, created: int, delta: Any, *, statuses: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A chat.completion from the joined result (see `join_deltas`; or the engine's `complete`).
    An error result raises its ProtocolError instead (the ingress answers with it)."""
    d = _as_dict(delta)
    reason = _finished(d, statuses)
    message: dict[str, Any] = {"role": "assistant", "content": d.get("text") or "", "refusal": None}
    if d.get("tool_calls"):
        message["tool_calls"] = d["tool_calls"]
        message["content"] = d.get("text") or None  # OpenAI sends null content beside calls
    if d.get("reasoning"):
        message["reasoning_content"] = d["reasoning"]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(d.get("logprobs")),
                "finish_reason": reason,
            }
        ],
        "usage": usage_dict(d.get("usage")),
    }


def completion_response(
    model: str, request_id: str, created: int, delta: Any, *, text_offset: int = 0, statuses: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """A text_completion from the joined result; an error result raises its ProtocolError."""
    d = _as_dict(delta)
    reason = _finished(d, statuses)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": d.get("text") or "",
                "logprobs": completion_logprobs(d.get("logprobs"), text_offset),
                "finish_reason": reason,
            }
        ],
        "usage": usage_dict(d.get("usage")),
    }


def embedding_vector(vector: Sequence[float], encoding_format: str = "float") -> list[float] | str:
    """One vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return [float(x) for x in vector]


def embedding_response(model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, encoding_format: str = "float") -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": embedding_vector(v, encoding_format)} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


# ---- streaming ---------------------------------------------------------------------------------


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event: b"data: {json}\\n\\n" (compact, UTF-8 kept as is)."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _client_reason(reason: str | None) -> str | None:
    """finish_reason a client may see: stop / length / tool_calls; error and cancelled are never
    sent as one."""
    return reason if reason in ("stop", "length", "tool_calls") else None


def chat_chunk(model: str, request_id: str, created: int, delta: Any, first: bool, *, include_usage: bool = False) -> dict[str, Any]:
    """One chat.completion.chunk. The first carries role "assistant" (and content, "" if none yet);
    the last carries finish_reason; with include_usage every chunk has "usage": null, as OpenAI's."""
    d = _as_dict(delta)
    text = d.get("text") or ""
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
    if text or first:
        body["content"] = text
    if d.get("reasoning"):
        body["reasoning_content"] = d["reasoning"]
    if d.get("tool_calls"):
        body["tool_calls"] = d["tool_calls"]
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": body,
                "logprobs": chat_logprobs(d.get("logprobs")),
                "finish_reason": _client_reason(d.get("finish_reason")),
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    model: str, request_id: str, created: int, delta: Any, first: bool = False, *, text_offset: int = 0, include_usage: bool = False
) -> dict[str, Any]:
    """One streamed text_completion chunk (the same object as the full response, this delta's
    text). `first` is accepted for symmetry with chat_chunk; a completion chunk has no role."""
    d = _as_dict(delta)
    chunk = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": d.get("text") or "",
                "logprobs": completion_logprobs(d.get("logprobs"), text_offset),
                "finish_reason": _client_reason(d.get("finish_reason")),
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(model: str, request_id: str, created: int, usage: Any, *, chat: bool = True) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_dict(usage),
    }


class StreamEncoder:
    """Engine deltas of one request -> SSE bytes, keeping the rules in one place: the first chat
    chunk names the role; empty deltas send nothing; finish_reason stop / length ends the choice;
    "cancelled" sends nothing (the client is gone); "error" sends the text so far, then an
    OpenAI-style {"error": {...}} event; `close` adds the usage chunk (if asked and no error) and
    [DONE]. A stream that stops without a finish_reason gets an error event at close.

        enc = StreamEncoder("chat", model, rid, created, include_usage=req.include_usage)
        async for d in actor_stream: yield enc.feed(d)   # b"" when there is nothing to send
        yield enc.close()
    """

    def __init__(
        self,
        kind: Literal["chat", "completion"],
        model: str,
        request_id: str,
        created: int,
        *,
        include_usage: bool = False,
        text_offset: int = 0,
        statuses: Mapping[str, int] | None = None,
    ):
        self.kind = kind
        self.model = model
        self.request_id = request_id
        self.created = created
        self.include_usage = include_usage
        self.text_offset = text_offset
        self.statuses = statuses
        self.first = True
        self.finished = False  # a finish_reason (any) was seen
        self.failed = False  # an error event was sent
        self.usage: Any = None

    def _chunk(self, d: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            chunk = chat_chunk(self.model, self.request_id, self.created, d, self.first, include_usage=self.include_usage)
        else:
            chunk = completion_chunk(self.model, self.request_id, self.created, d, text_offset=self.text_offset, include_usage=self.include_usage)
            self.text_offset += sum(len(_entry(lp)[0]) for lp in d.get("logprobs") or ())
        self.first = False
        return chunk

    def feed(self, delta: Any) -> bytes:
        if self.finished or self.failed:
            return b""
        d = _as_dict(delta)
        reason = d.get("finish_reason")
        if reason == "cancelled":
            self.finished = True
            return b""
        out = []
        shows = d.get("text") or d.get("logprobs") or d.get("reasoning") or d.get("tool_calls") or _client_reason(reason)
        if shows or (self.first and self.kind == "chat" and reason is None):
            out.append(sse(self._chunk(d)))
        if d.get("usage") is not None:
            self.usage = d["usage"]
        error = error_from_delta(d, self.statuses)
        if error is not None:
            out.append(sse(error.body()))
            self.failed = True
        if reason is not None:
            self.finished = True
        return b"".join(out)

    def error(self, code: str, message: str, param: str | None = None, status: int | None = None) -> bytes:
        """An error event for a failure outside the deltas (the actor died mid-stream, ...)."""
        if self.failed:
            return b""
        self.failed = True
        return sse(error_body(status or _status(code, self.statuses), code, message, param))

    def close(self) -> bytes:
        out = []
        if not self.finished and not self.failed:
            out.append(self.error("internal", "the stream ended without a finish reason"))
        elif not self.failed and self.include_usage and self.usage is not None:
            out.append(sse(usage_chunk(self.model, self.request_id, self.created, self.usage, chat=self.kind == "chat")))
        out.append(SSE_DONE)
        return b"".join(out)
