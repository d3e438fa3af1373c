"""Every error the app answers, in the protocol the client speaks, from one set of handlers.

Below the routes everything raises `OrchardError` (deployments/wire/failure.py); FastAPI's own failures (a
body that does not validate, an unknown route, a wrong method) and anything unexpected arrive
here too. The protocol is the route's: Anthropic's `{"type": "error", ...}` under /v1/messages,
OpenAI's `{"error": {...}}` everywhere else, unknown routes included. A status with a retry
carries Retry-After.

What a user key may read of an error is decided here too (`for_principal`): its own request, key and
model, never the cluster's other models, nodes, memory or files."""

import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.wire.failure import OrchardError
from router.protocols import anthropic as anth, openai as oai

Protocol = Literal["openai", "anthropic"]
log = logging.getLogger("orchard.ingress")


def protocol_of(path: str) -> Protocol:
    return "anthropic" if path == "/v1/messages" or path.startswith("/v1/messages/") else "openai"


def error_response(protocol: Protocol, e: OrchardError) -> JSONResponse:
    """`e` in the protocol's own body, with its status and, when waiting could help, Retry-After."""
    status = e.status
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else None
    if protocol == "anthropic":
        body = anth.error_body(status, e.message, e.code)
    else:
        body = oai.error_body(status, e.code, e.message, e.param, getattr(e, "type", None))
    return JSONResponse(body, status_code=status, headers=headers)


def validation_error(protocol: Protocol, errors: list) -> OrchardError:
    """FastAPI's RequestValidationError.errors() -> the protocol's 400 naming the first bad field."""
    if any(err.get("type") == "json_invalid" for err in errors):
        return oai.ProtocolError(400, "invalid_json", "We could not parse the JSON body of your request.")
    if any(err.get("type") == "missing" and tuple(err.get("loc") or ()) == ("body",) for err in errors):
        return oai.ProtocolError(400, "invalid_type", "The request body must be a JSON object.")
    # a query or path parameter is named by itself (a body field's "body" prefix the parsers drop)
    errors = [err | {"loc": tuple(err["loc"])[1:]} if tuple(err.get("loc") or ())[:1] in (("query",), ("path",)) else err for err in errors]
    return anth.validation_error(errors) if protocol == "anthropic" else oai.validation_error(errors)


_HTTP_CODES = {404: "route_not_found", 405: "method_not_allowed", 413: "request_too_large"}

# Codes whose messages speak only of the caller's own request, key or model (a bad field, a prompt
# over the context, a model that cannot do what was asked, the key's own limits): every key reads
# them as they are. Any other code (placement refusals, load failures, instances gone, internal
# errors, and any code added later) reaches a user key with a neutral message: those name other
# models, nodes, their memory or the store's paths. Admin keys read every message; the details also
# stay in the cluster's events (GET /v1/cluster/events, admin keys only).
USER_SAFE_CODES = frozenset(
    {
        "invalid_request",
        "context_length_exceeded",
        "unsupported",
        "cancelled",
        "model_not_found",
        "model_not_supported",
        "unsupported_content",
        "tools_not_supported",
        "invalid_api_key",
        "permission_denied",
        "rate_limited",
        "route_not_found",
        "method_not_allowed",
        "file_too_large",
    }
)


def for_principal(e: OrchardError, admin: bool, model: str) -> OrchardError:
    """`e` as the key that made the request may read it: as it is for an admin key or a code in
    USER_SAFE_CODES, else the same code, status, parameter and Retry-After with a message that
    names only `model` (the model the key asked for)."""
    if admin or e.code in USER_SAFE_CODES:
        return e
    if e.status >= 500 and e.status != 503:
        message = f"model {model!r} failed to answer this request ({e.code})"
    else:
        message = f"model {model!r} cannot serve requests right now ({e.code})"
    if e.retry_after_s:
        message += f"; retry in {max(1, round(e.retry_after_s))} s"
    return OrchardError(
        e.code, message + "; an operator can see why in the cluster's events and logs", e.param, retry_after_s=e.retry_after_s, status=e.status
    )


def install(app: FastAPI) -> None:
    """The app's exception handlers: one per kind of failure, each rendering by the route's protocol."""

    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, e: OrchardError) -> JSONResponse:
        return error_response(protocol_of(request.url.path), e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        protocol = protocol_of(request.url.path)
        return error_response(protocol, validation_error(protocol, list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(e.status_code, "invalid_request" if e.status_code < 500 else "internal")
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see /openapi.json for the API"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        response = error_response(protocol_of(request.url.path), OrchardError(code, message, status=e.status_code))
        if e.headers:
            response.headers.update(e.headers)
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(protocol_of(request.url.path), OrchardError("internal", f"internal error: {type(e).__name__}"))
