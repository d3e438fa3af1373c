"""The parser chain between the engine's stream and the protocols: reasoning split, then tool calls.

The engine streams delta dicts (text, token_ids, finish_reason, usage, error, error_code,
stop_sequence); every protocol consumes the same OutputEvents (router/output_events.py), so the
chain runs once per generation whatever the protocol. Reasoning is split first: a call a model
drafts while thinking is reasoning, not a call. gpt-oss (family "harmony") says both in one syntax,
its channels: one parser (router.serving.output.harmony) splits reasoning, text and calls, and it
runs whether or not the request enabled tools, since its answer is in a channel too.

Finish rules: exactly one Finish, always the last event, emitted with the delta that carries
finish_reason (or by `close()` when the stream ends without one). Everything a parser still holds
is flushed before it. The reason becomes "tool_calls" when at least one complete call was parsed
and the engine stopped naturally ("stop"); a call cut off by max_tokens is text and the reason
stays "length"."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, field_validator

from router.protocols.events import Finish, FinishReason, OutputEvent, ReasoningDelta, TextDelta
from router.serving.output.harmony import HarmonyParser
from router.serving.output.reasoning import ReasoningConfig, ReasoningSplitter
from router.serving.output.tool_parser_base import IdFactory, ToolParser
from router.serving.output.tool_parsers import ALIASES, FAMILIES, UnknownToolParser, get_parser


class OutputConfig(BaseModel):
    """How one model's output is parsed: the registry's `tool_parser` (a family in
    router.serving.output.tool_parsers.FAMILIES, or None) and `reasoning` (markers, or None for a model that does
    not reason; `true` means the default `<think>` markers; harmony has its own and ignores them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_parser: str | None = None
    reasoning: ReasoningConfig | None = None

    @field_validator("tool_parser")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and ALIASES.get(v, v) not in FAMILIES:
            raise ValueError(str(UnknownToolParser(v)))
        return ALIASES.get(v, v) if v is not None else None

    @field_validator("reasoning", mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if v is True:
            return ReasoningConfig()
        if v is False:
            return None
        return v


_REASONS = set(get_args(FinishReason))


def tools_enabled(tools: list | None, tool_choice: Any = None) -> bool:
    """Whether a request lets the model call tools: tools given and tool_choice not "none"
    (OpenAI's string, or an object of type "none" as Anthropic spells it)."""
    if not tools:
        return False
    return not (tool_choice == "none" or (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "none"))


def _field(delta: Any, key: str) -> Any:
    if isinstance(delta, Mapping):
        return delta.get(key)
    return getattr(delta, key, None)


def _coalesce(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent text (or reasoning) pieces of one feed become one event."""
    out: list[OutputEvent] = []
    for e in events:
        if out and isinstance(e, (TextDelta, ReasoningDelta)) and type(out[-1]) is type(e):
            out[-1] = type(e)(text=out[-1].text + e.text)
        else:
            out.append(e)
    return out


class OutputParser:
    """One generation's parser chain. `feed(delta)` per engine delta (a dict or the engine's Delta
    model); `tools` says whether this request enabled tools (see `tools_enabled`): without it the
    model's tool syntax is plain text. `tool_specs` are the request's tools (OpenAI shape), which
    some families' parsers read to type argument values (qwen3_coder, glm47, minimax_m2)."""

    def __init__(
        self, config: OutputConfig | None = None, *, tools: bool = False, tool_specs: list[dict] | None = None, new_id: IdFactory | None = None
    ):
        config = config or OutputConfig()
        self._tools: ToolParser | None = None
        if config.tool_parser == "harmony":  # reasoning, text and calls in one syntax
            self._reasoning = None
            self._tools = HarmonyParser(new_id, tool_specs, calls=tools)
        else:
            self._reasoning = ReasoningSplitter(config.reasoning) if config.reasoning else None
            if tools and config.tool_parser:
                self._tools = get_parser(config.tool_parser, new_id, tool_specs)
        self.finished = False

    @property
    def transforms(self) -> bool:
        """Whether this chain can change the text at all (reasoning markers or tool parsing on):
        an OpenAI chat stream without either needs no parsing, and skips it."""
        return self._reasoning is not None or self._tools is not None

    @property
    def tool_calls(self) -> int:
        """Complete calls parsed so far."""
        return self._tools.calls if self._tools else 0

    def feed(self, delta: Mapping | Any) -> list[OutputEvent]:
        """Events for one engine delta; the last delta (finish_reason set) also flushes and finishes.
        Deltas after the Finish are ignored."""
        if self.finished:
            return []
        events = self._text(_field(delta, "text") or "")
        reason = _field(delta, "finish_reason")
        if reason is not None:
            usage = _field(delta, "usage") or {}
            events += self._finish(
                reason,
                prompt_tokens=_field(usage, "prompt_tokens") or 0,
                completion_tokens=_field(usage, "completion_tokens") or 0,
                cached_tokens=_field(usage, "cached_tokens") or 0,
                stop_sequence=_field(delta, "stop_sequence"),
                error=_field(delta, "error"),
                error_code=_field(delta, "error_code"),
            )
        return _coalesce(events)

    def close(self, reason: str = "cancelled", error: str | None = None, error_code: str | None = None) -> list[OutputEvent]:
        """Finish a stream that ended without a finish_reason (client gone, engine lost): flushes,
        then the one Finish. Nothing after a Finish was already emitted."""
        if self.finished:
            return []
        return _coalesce(self._finish(reason, error=error, error_code=error_code))

    def _text(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        events: Iterable[OutputEvent] = self._reasoning.feed(text) if self._reasoning else [TextDelta(text=text)]
        return self._calls(events)

    def _calls(self, events: Iterable[OutputEvent]) -> list[OutputEvent]:
        if not self._tools:
            return list(events)
        out: list[OutputEvent] = []
        for e in events:
            out += self._tools.feed(e.text) if isinstance(e, TextDelta) else [e]
        return out

    def _finish(self, reason: str, **fields: Any) -> list[OutputEvent]:
        self.finished = True
        if reason not in _REASONS:  # never lose the Finish to a value the contract lacks
            fields["error"] = fields.get("error") or f"unknown finish_reason {reason!r}"
            reason = "error"
        events = self._calls(self._reasoning.finish()) if self._reasoning else []
        if self._tools:
            events += self._tools.finish()
        if reason == "stop" and self.tool_calls:
            reason = "tool_calls"
        return events + [Finish(reason=reason, **fields)]
