"""OpenAI's request bodies: chat completions, completions and embeddings, and `parse_body`, through
which every protocol's parser goes.

Requests accept OpenAI's whole documented field set for chat completions, completions and
embeddings, because real clients (the openai SDK, LangChain, editors) send fields such as `user`,
`store`, `metadata` or `stream_options` whatever the server. A field Orchard cannot honour (n > 1,
deprecated `functions`, audio, best_of > 1, echo, suffix, ...) is a 400 that names it in
`param`: silently ignoring it would change what the client gets back. Fields that are hints only
(`user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`, `prediction`, `verbosity`,
`parallel_tool_calls`, ...) are accepted and ignored. Keys that OpenAI does not document at all are
ignored too (listed by `ignored_fields`), as local servers do, except the common local-server
sampling extras `top_k`, `min_p`, `repetition_penalty` and `chat_template_kwargs`, which are honoured."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.engines.chat_format import TEMPLATE_STRING_MAX, template_kwargs_error
from router.protocols.openai.errors import ProtocolError, _invalid, _unsupported, validation_error
from router.protocols.openai.parts import ChatMessage, ResponseFormat, StreamOptions, Tool

MAX_STOP = 8  # OpenAI allows 4; the engine takes 8
MAX_TOP_LOGPROBS = 20


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
    reasoning_effort: str | None = Field(
        default=None, max_length=TEMPLATE_STRING_MAX
    )  # passed to the chat template (gpt-oss style templates read it)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: variables for the chat template (template variables only)
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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Template variables only (deployments/engines/chat_format.py's TEMPLATE_VARIABLES): a
        template of the client's own or a tokenizer argument would run on the instance's tokenizer."""
        refused = template_kwargs_error(v) if v is not None else None
        if refused is not None:
            name, why = refused
            raise _invalid(why, at=name)
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
