"""The one failure type that crosses a process boundary, and the one table from its codes to HTTP
statuses.

The controller, the serving layer and the model servers raise `OrchardError` with a code (and the
parameter at fault, and when a retry could help); none of them carries an HTTP status. A model
server's failure reaches its caller as the same OrchardError (it pickles by its fields; Ray's
wrappers are taken off by `deployments.failures.unwrap`), and an engine's in-process
`RequestError` becomes one before it leaves the model server. The status
is looked up here, by code, when router/api turns the error into the protocol's own body (one
exception handler per protocol) and when a protocol encoder reports a failure mid-stream.
Protocol parsers are the one exception: a wire error whose status the protocol itself defines
(a malformed body is a 400 whatever its code) may give `status`.

Importing this module imports nothing else of Orchard's: every layer may use it."""

from typing import Any

# code -> HTTP status. Codes not listed are client errors (400) when they name a parameter and
# server errors (500) otherwise; see `status_of`.
STATUS: dict[str, int] = {
    # engines and model servers (deployments/engine.py RequestError codes, deployments/failures.py)
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "unsupported": 400,
    "not_found": 404,
    "cancelled": 499,
    "internal": 500,
    "engine_stopped": 503,
    "load_failed": 503,
    "unavailable": 503,
    # the residency controller
    "model_not_found": 404,
    "node_not_found": 404,
    "model_pinned": 409,
    "model_already_loaded": 409,
    "model_busy": 503,
    "model_too_large": 503,
    "model_no_eligible_node": 503,
    "model_blocked": 503,
    "model_load_failed": 503,
    "model_unloaded": 503,
    "model_unavailable": 503,
    "model_gave_up": 503,
    # the node stores (router/residency/effects.py, cluster/store.py)
    "files_not_stored": 404,
    "files_in_use": 409,
    "last_stored_copy": 409,
    "fetch_failed": 503,
    "model_fetching": 503,
    # what a model cannot do (router/serving)
    "model_not_supported": 400,
    "unsupported_content": 400,
    "tools_not_supported": 400,
    # an instance's process died while running the request, which is not retried (router/serving/generation.py)
    "model_crashed": 502,
    # the HTTP surface
    "invalid_api_key": 401,
    "permission_denied": 403,
    "rate_limited": 429,
    "not_ready": 503,
    "route_not_found": 404,
    "method_not_allowed": 405,
    "file_too_large": 413,
    # the app's door (router/api/guard.py)
    "request_too_large": 413,
    "unsupported_media_type": 415,
    "host_not_allowed": 421,
    "empty_stream": 500,
}


def status_of(code: str | None, param: str | None = None) -> int:
    """The HTTP status for an error code (see STATUS)."""
    if code in STATUS:
        return STATUS[code]
    return 400 if param is not None else 500


class OrchardError(Exception):
    """A request that cannot be served: `code` (what went wrong, machine-readable), `message`
    (what a person reads), `param` (the request field at fault), `retry_after_s` (when retrying
    could help: becomes Retry-After). `status` is derived from the code unless a protocol parser
    set it."""

    def __init__(self, code: str, message: str, param: str | None = None, *, retry_after_s: float | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self._status = status

    @property
    def status(self) -> int:
        return self._status if self._status is not None else status_of(self.code, self.param)

    def __str__(self) -> str:  # the message alone, so str(e) can go to a client as is
        return self.message

    def __reduce__(self):  # pickles by its fields, whatever else was attached (it crosses Ray)
        return (_rebuild, (type(self), self.code, self.message, self.param, self.retry_after_s, self._status))

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "retry_after_s": self.retry_after_s}


def _rebuild(cls: type[OrchardError], code: str, message: str, param: str | None, retry_after_s: float | None, status: int | None) -> OrchardError:
    error = OrchardError.__new__(cls)
    OrchardError.__init__(error, code, message, param, retry_after_s=retry_after_s, status=status)
    return error
