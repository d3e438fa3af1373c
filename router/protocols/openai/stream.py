"""OpenAI's streamed results: server-sent events, chat.completion.chunk and text_completion chunks, the
usage chunk, and StreamEncoder, which turns one request's engine deltas into SSE bytes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from router.protocols.openai.encoder import (
    _as_dict,
    _entry,
    _status,
    chat_logprobs,
    completion_logprobs,
    error_from_delta,
    usage_dict,
)
from router.protocols.openai.errors import error_body

SSE_DONE = b"data: [DONE]\n\n"


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
