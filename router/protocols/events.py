"""Protocol-neutral output of one generation, after reasoning and tool-call parsing.

The engine streams text deltas; `router.serving.output.parsing` turns them into these events; each
protocol (OpenAI chat, OpenAI Responses, Anthropic Messages) encodes the same events its own way.
That is what keeps protocol translation separate from model execution: every protocol reaches every
engine through one lease-and-stream path and one parser chain."""

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TextDelta(_Event):
    """Visible answer text."""

    type: Literal["text"] = "text"
    text: str


class ReasoningDelta(_Event):
    """Text inside the model's reasoning markers (<think>...</think> or configured ones)."""

    type: Literal["reasoning"] = "reasoning"
    text: str


class ToolCallStart(_Event):
    """A tool call begins: its position among this answer's calls, a fresh id, the function name."""

    type: Literal["tool_call_start"] = "tool_call_start"
    index: int
    id: str
    name: str


class ToolCallArguments(_Event):
    """A piece of the JSON arguments of call `index` (the pieces concatenated are the arguments)."""

    type: Literal["tool_call_arguments"] = "tool_call_arguments"
    index: int
    arguments: str


class ToolCallEnd(_Event):
    type: Literal["tool_call_end"] = "tool_call_end"
    index: int


FinishReason = Literal["stop", "length", "tool_calls", "error", "cancelled"]


class Finish(_Event):
    """Always the last event of a generation, exactly once. `reason` is "tool_calls" when the
    answer made at least one call and stopped naturally. Usage counts tokens as the engine did."""

    type: Literal["finish"] = "finish"
    reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended the answer, when one did
    error: str | None = None
    error_code: str | None = None


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | Finish
