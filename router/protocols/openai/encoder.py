"""The engine's Delta dicts -> OpenAI's whole (non-streamed) results: deltas joined into one, the
output parser's events folded in, errors, usage, logprobs, chat.completion, text_completion and
embedding lists. The streamed shapes build on these (router.protocols.openai.stream)."""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from router.protocols.openai.errors import ENGINE_STATUS, ProtocolError

MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of (near) zero probability; JSON has no -inf


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
