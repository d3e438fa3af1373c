"""A generation as it crosses between an ingress replica and a model server.

The ingress sends a request (`GenerationRequest` for an LLM, `VLMRequest` for a vision-language
model); the model server answers on its caller's channel with `ChannelItem`s (a `GenerationDelta`,
or the request's `OrchardError` when it failed before any output), or, for a generation wanted
whole, with one `WholeGeneration` (or the OrchardError).

Why the delta is a TypedDict and everything else a pydantic model: a delta crosses once per
stream per flush, thousands of times a second at GPU rates, and is read on the ingress by the
output parsers and every protocol's encoder. Built, pickled in a flush of 16 (Ray's serializer)
and unpickled and read (`python -m bench.wire.delta`, 2-core x86 VM), a one-token delta costs
1.6 us as a dict, which this TypedDict is at run time (typed for mypy, free for Python), against
11.0 us (7.0x) as a frozen pydantic model and 13.5 us built without validation (model_construct
runs in Python); pickling and unpickling alone are 1.1 us against 8.5 us. At 64 streams of 100
tokens/s that is about 60 ms of CPU a second, split between the model server and the ingress, that
the dict does not spend. The requests and the whole reply cross once per request, where validation
is worth its cost.

Importing this module imports pydantic and Orchard's failure type, nothing heavy (no Ray, no MLX):
the protocols build requests with it without importing an engine."""

import warnings
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12 (WholeReply holds a delta)

from deployments.wire.failure import OrchardError
from policy._frozen import Frozen

FinishReason = Literal["stop", "length", "cancelled", "error"]

with warnings.catch_warnings():  # the field `schema` shadows BaseModel.schema(), a deprecated classmethod
    warnings.filterwarnings("ignore", message='Field name "schema"', category=UserWarning)

    class Constraint(Frozen):
        """What the output must match. json_object: any JSON object; json_schema: `schema` (with
        `strict=False`, keywords llguidance does not implement are ignored instead of refused); regex:
        `pattern` (the whole output); lark: `grammar`, llguidance's Lark dialect (`%json {schema}` inline;
        a %json block takes the schema's own "x-guidance" options, whitespace-flexible by default).
        `param`: the request field it came from, which a constraint that does not compile names
        (response_format unless said: a forced tool call's grammar says tools)."""

        type: Literal["json_object", "json_schema", "regex", "lark"]
        schema: dict[str, Any] | None = None  # type: ignore[assignment]
        strict: bool = True
        pattern: str | None = None
        grammar: str | None = None
        param: Literal["response_format", "tools"] = "response_format"

        @model_validator(mode="after")
        def _needs_its_field(self) -> "Constraint":
            needed = {"json_schema": "schema", "regex": "pattern", "lark": "grammar"}.get(self.type)
            if needed is not None and getattr(self, needed) is None:
                raise ValueError(f"a {self.type} constraint needs `{needed}`")
            return self


class GenerationRequest(Frozen):
    """One completion of an LLM. Exactly one of prompt (raw text), messages (chat) or prompt_tokens.

    messages may hold OpenAI tool history: assistant messages with `tool_calls` (content None) and
    role "tool" messages with `tool_call_id`. `tools` are OpenAI function tools; a chat template
    that knows tools gets them, any other renders them through `chat_format`. `constraint` makes
    the output match a JSON object / JSON schema / regex / Lark grammar (`constrained`)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_tokens: list[int] | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=8)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    constraint: Constraint | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or ()):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f'tools[{i}] is not {{"type": "function", "function": {{"name": ..., ...}}}}')
        return tools

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerationRequest":
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_tokens)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_tokens")
        return self


class VLMRequest(Frozen):
    """One chat completion of a vision-language model: messages whose image parts are
    {"type": "image"} in order, the images (data: URLs, or http(s) URLs where the operator allows
    them) in the same order, and the sampling controls the VLM engine has. Ranges are the engine's
    to check (it names the field at fault)."""

    messages: list[dict[str, Any]]
    images: list[str] = Field(default_factory=list)
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = Field(default_factory=list)


def parse_request(model: type[GenerationRequest] | type[VLMRequest], data: Any) -> Any:
    """`data` (the model itself, or its fields as a dict) as `model`, or the invalid_request
    OrchardError naming the first field at fault: the one check both ends run."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise OrchardError("invalid_request", f"{param + ': ' if param else ''}{first['msg']}", param) from None


class DeltaUsage(TypedDict, total=False):
    """Tokens a generation used, on its final delta (cached_tokens: an LLM's prompt tokens read
    from its prefix cache)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class DeltaLogprob(TypedDict):
    """One generated token's log-probability and its `top` alternatives as (id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]


class GenerationDelta(TypedDict, total=False):
    """A piece of one generation's output, as the model server sends it (several merged into one
    per flush: text and token ids joined, the last one's finish). An LLM's delta lists its
    `token_ids` (and `logprobs` when asked); a VLM's carries text alone. The final delta has
    `finish_reason` and `usage`; one that ends in "error" after some output also names the failure
    (`error`: its message, `error_code`, `error_param`), whose code the one status table maps like
    an OrchardError's. `stop_sequence`: the stop string that ended it."""

    text: str
    token_ids: list[int]
    logprobs: list[DeltaLogprob] | None
    finish_reason: FinishReason | None
    usage: DeltaUsage | None
    error: str | None
    error_code: str | None
    error_param: str | None
    stop_sequence: str | None


# One item of a model server's channel for one request: a delta, or the request's failure before
# any output (its only item).
ChannelItem = GenerationDelta | OrchardError


class WholeReply(Frozen):
    """The one reply of a generation wanted whole (`ModelServer.generate_whole`): every delta
    merged into one (an error after some output is its finish_reason "error"), the seconds from
    its start to its first delta (`first_s`) and from there to its end (`last_s`)."""

    delta: GenerationDelta
    first_s: float = Field(ge=0)
    last_s: float = Field(ge=0)
