"""Output events (router.protocols.events) -> a Response object (`response_object`) and the Responses
SSE stream (`ResponseStreamEncoder`), with usage and failures in OpenAI's shape."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from router.protocols.events import (
    Finish,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from router.protocols.openai import ProtocolError, error_type, finish_error
from router.protocols.responses.requests import ResponsesRequest


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


def _failure_code(status: int) -> str:
    """A Response's `error.code` (OpenAI's fixed list) for an HTTP status."""
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(status, "server_error")


def _sse(data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {data['type']}\ndata: {payload}\n\n".encode()


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def _custom_input(arguments: str) -> str:
    """A custom tool call's freeform input from the arguments the model wrote for its function of
    one string (`{"input": ...}`); arguments that are not that object are the input as they are."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


class ResponseStreamEncoder:
    """Output events of one generation -> the Responses SSE stream:

        response.created, response.in_progress,
        per output item: response.output_item.added,
          message:       content_part.added, output_text.delta*, output_text.done, content_part.done
          reasoning:     content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
          function_call: function_call_arguments.delta*, function_call_arguments.done
          custom_tool_call: custom_tool_call_input.delta (the whole input), custom_tool_call_input.done
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
        self._tools = {t.name: t for t in req.function_tools}  # the names the model was offered
        self._custom_arguments: dict[int, str] = {}  # a custom tool call's arguments (JSON) until it ends
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
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,  # the route stores it unless asked not to
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
        elif item["type"] == "custom_tool_call":
            item["input"] = _custom_input(self._custom_arguments.pop(index, ""))
            if item["input"]:
                out.append({"type": "response.custom_tool_call_input.delta", **where, "delta": item["input"]})
            out.append({"type": "response.custom_tool_call_input.done", **where, "input": item["input"]})
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
            tool = self._tools.get(event.name)
            name = tool.tool_name if tool is not None else event.name
            item = {"id": self._item_id("fc"), "type": "function_call", "call_id": event.id, "name": name, "arguments": "", "status": "in_progress"}
            if tool is not None and tool.custom:  # its input comes whole at the call's end (the model writes it as JSON)
                item = {
                    "id": self._item_id("ctc"),
                    "type": "custom_tool_call",
                    "call_id": event.id,
                    "name": name,
                    "input": "",
                    "status": "in_progress",
                }
                self._custom_arguments[len(self.output)] = ""
            if tool is not None and tool.namespace is not None:
                item["namespace"] = tool.namespace
            out += self._add(("tool", event.index), item)
        elif isinstance(event, ToolCallArguments):
            index = self._open.get(("tool", event.index))
            if index is not None and index in self._custom_arguments:
                self._custom_arguments[index] += event.arguments
            elif index is not None and event.arguments:
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
