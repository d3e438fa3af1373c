"""Output events (router.protocols.events) -> Anthropic's message object (`message_response`) and its
SSE stream (`MessageStreamEncoder`); stop reasons, usage and the count_tokens answer."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from router.protocols.anthropic.errors import error_body
from router.protocols.events import (
    Finish,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from router.protocols.openai import ProtocolError, finish_error


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
