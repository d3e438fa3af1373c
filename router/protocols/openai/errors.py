"""OpenAI's error shape: the body ({"error": {"message", "type", "param", "code"}}), ProtocolError, and
pydantic validation errors turned into one 400 naming the first bad field.

Error `param` paths follow OpenAI's spelling: dotted names with bracketed indices
(`messages[0].content[1].image_url.url`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from deployments.wire.failure import STATUS, OrchardError
from router.protocols.events import Finish

# The status of each error code: the one table (deployments/wire/failure.py).
ENGINE_STATUS = STATUS


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


def finish_error(finish: Finish, statuses: Mapping[str, int] | None = None) -> ProtocolError | None:
    """The error a Finish reports (reason error / cancelled), or None."""
    if finish.reason == "cancelled":
        return ProtocolError(499, "cancelled", "the request was cancelled")
    if finish.reason != "error":
        return None
    code = finish.error_code or "internal"
    return ProtocolError((statuses or ENGINE_STATUS).get(code, 500), code, finish.error or "generation failed")
