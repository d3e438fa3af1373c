"""Anthropic's error shape: {"type": "error", "error": {"type", "message"}} (HTTP and SSE), its error
types by status, and pydantic validation errors as one 400 in Anthropic's path spelling."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from router.protocols.openai import ProtocolError

AnthropicErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
]


def error_type(status: int, code: str | None = None) -> AnthropicErrorType:
    """Anthropic's error `type` for an HTTP status. 503 is overloaded_error (the model is stopped or
    busy: retry later), except a model that failed to load (code load_failed), an api_error."""
    by_status: dict[int, AnthropicErrorType] = {
        401: "authentication_error",
        402: "billing_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        504: "timeout_error",
        529: "overloaded_error",
    }
    if status in by_status:
        return by_status[status]
    if status == 503:
        return "api_error" if code == "load_failed" else "overloaded_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}: Anthropic's error body (HTTP and SSE)."""
    return {"type": "error", "error": {"type": error_type(status, code), "message": message}}


def protocol_error_body(error: ProtocolError) -> dict[str, Any]:
    """The Anthropic body for a ProtocolError (raised by the parsers here, by the shared chat
    validation, or for an engine error); the HTTP status is `error.status`."""
    return error_body(error.status, error.message, error.code)


def _path(loc: Iterable[Any]) -> str:
    """('messages', 0, 'content') -> 'messages.0.content' (Anthropic's spelling)."""
    return ".".join(str(p) for p in loc)


def validation_error(error: ValidationError | Sequence[Mapping[str, Any]]) -> ProtocolError:
    """Pydantic errors (or FastAPI's RequestValidationError.errors(), locations starting with
    "body") -> one 400 invalid_request_error naming the first bad field, as Anthropic does:
    "messages.0.content.1.source: Field required"."""
    errors = error.errors() if isinstance(error, ValidationError) else list(error)
    if not errors:
        return ProtocolError(400, "invalid_request", "invalid request", type="invalid_request_error")
    first = errors[0]
    loc = list(first.get("loc") or ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    ctx = first.get("ctx") or {}
    if first.get("type") == "orchard" and ctx.get("at"):
        loc += str(ctx["at"]).split(".")
    path = _path(loc)
    msg = str(first.get("msg") or "invalid value").removeprefix("Value error, ")
    if first.get("type") in ("model_type", "dict_type") and not path:
        msg = "The request body must be a JSON object."
    message = f"{path}: {msg}" if path else msg
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request)"
    code = ctx.get("code") if first.get("type") == "orchard" else "invalid_request"
    return ProtocolError(400, code or "invalid_request", message, path or None, type="invalid_request_error")
