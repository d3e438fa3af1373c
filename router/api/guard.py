"""The app's door: one pure ASGI middleware that decides from the request's headers alone, before a
byte of its body is read, whether the request may come in (router/api/app.py puts it outermost).

In order, each refusal in the route's protocol (router/api/errors.py) and, while a body may still
be on its way, with `Connection: close` (the server does not read what it refused):

1. Host: a name a DNS-rebinding page could have chosen is refused (421). Allowed: localhost, any IP
   literal (127.0.0.2 included: a rebinding page's requests carry its own domain name, never an
   address), the nodes' host names, and ray-config.yaml's `allowed_hosts` ("*": any, behind a proxy
   that checks them).
2. The key (the one place it is checked): `Authorization: Bearer <key>` or `x-api-key: <key>`,
   identified against the ingress's principals (router/api/keys.py) and kept in the scope for the
   `principal` dependency (router/api/auth.py). No keys configured: everyone is the open principal.
   A route that exists and needs a key answers 401 without one; /health, /ready and the API's docs
   need none; an unknown route or method goes on to its 404 / 405.
3. A POST that a web page could send to another site without asking first (no JSON Content-Type and
   no key header: text/plain, a form, multipart, or no body at all) is refused (415), so without keys
   no page in the operator's browser can load, unload, pin, pull or generate. (A DELETE or PUT always
   needs the browser's CORS preflight, which this app never grants.)
4. Size: a Content-Length over the route's limit is refused (413) before reading; any other body is
   cut off at the limit as it arrives (Starlette's RequestBodyLimitMiddleware, whose 413 the app's
   handlers answer in the protocol's format). The limit is `max_request_bytes`, or `max_audio_bytes`
   (plus room for the multipart fields) on upload routes."""

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from deployments.wire.failure import OrchardError
from router.api.errors import error_response, protocol_of
from router.api.ingress import current
from router.api.keys import OPEN, Principal, identify

PRINCIPAL = "orchard.principal"  # the scope key the principal is kept under
MULTIPART_ROOM = 64 * 1024  # an upload route's limit over max_audio_bytes: the form's other fields and boundaries
JSON_TYPES = ("application/json",)


class GuardSettings(BaseModel):
    """What the deployment tells the guard (IngressDeployment, from ray-config.yaml's args)."""

    model_config = ConfigDict(frozen=True)

    max_request_bytes: int = Field(default=16 * 1024**2, ge=1)
    max_audio_bytes: int = Field(default=25 * 1024**2, ge=1)
    allowed_hosts: frozenset[str] = frozenset()  # beyond localhost and IP literals; "*": any; "*.example.com": its subdomains


# An app no deployment configured (FastAPI's TestClient in unit tests, whose Host is "testserver")
# checks no Host; every deployed ingress is configured by IngressDeployment before it serves.
UNCONFIGURED = GuardSettings(allowed_hosts=frozenset({"*"}))
_SETTINGS: list[GuardSettings] = []


def configure(settings: GuardSettings | None) -> None:
    """Make `settings` the guard's in this process (None: back to UNCONFIGURED)."""
    _SETTINGS[:] = [settings] if settings is not None else []


def settings() -> GuardSettings:
    return _SETTINGS[0] if _SETTINGS else UNCONFIGURED


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port or brackets, lowercase, without a trailing dot."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.lower().rstrip(".")


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    if host_header is None or "*" in allowed:  # no Host (HTTP/1.0): no name a page could have chosen
        return True
    host = host_name(host_header)
    if host == "localhost" or host in allowed:
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return any(pattern.startswith("*.") and host.endswith(pattern[1:]) for pattern in allowed)


def is_loopback(host: str) -> bool:
    """Whether a bind address only takes connections from this machine."""
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name(host)).is_loopback
    except ValueError:
        return False


def route_path(scope: Scope) -> str:
    """The path the app routes by: without the root path a mount or Serve's route prefix put before it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def principal_of(scope: Scope) -> Principal | None:
    return scope.get(PRINCIPAL)


class Guard:
    """`routes`: the app's router (to tell a route that exists from a 404 / 405); `keyless`: the
    paths that need no key; `uploads`: the paths whose limit is max_audio_bytes."""

    def __init__(self, app: Any, routes: Any, keyless: frozenset[str] = frozenset(), uploads: frozenset[str] = frozenset()):
        self.app = app
        self.routes = routes
        self.keyless = keyless
        self.uploads = uploads

    def _routed(self, scope: Scope) -> bool:
        """Whether a route answers this method and path (only asked on the way to a refusal)."""
        return any(route.matches(scope)[0] == Match.FULL for route in self.routes.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)  # the first of a repeated header, as Starlette reads it
        s = settings()
        path = route_path(scope)
        refusal = await self._refusal(scope, path, headers, s)
        if refusal is not None:
            await self._refuse(scope, receive, send, headers, refusal)
            return
        limit = s.max_audio_bytes + MULTIPART_ROOM if path in self.uploads else s.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            name = "max_audio_bytes" if path in self.uploads else "max_request_bytes"
            refusal = OrchardError("request_too_large", f"the request body is {int(length)} bytes, over this route's limit of {limit} ({name})")
            await self._refuse(scope, receive, send, headers, refusal)
            return

        async def send_closing_on_413(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 413:  # a body cut off: the rest is not read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await RequestBodyLimitMiddleware(self.app, limit)(scope, receive, send_closing_on_413)

    async def _refusal(self, scope: Scope, path: str, headers: dict[bytes, bytes], s: GuardSettings) -> OrchardError | None:
        host = headers.get(b"host")
        if not host_allowed(host.decode("latin-1") if host is not None else None, s.allowed_hosts):
            return OrchardError(
                "host_not_allowed",
                f"this server does not answer to the host name {host_name(host.decode('latin-1'))!r} (add it to ray-config.yaml args.allowed_hosts)",  # type: ignore[union-attr]  # not None when refused
            )
        if path in self.keyless:
            return None
        try:
            ingress = await current()
        except OrchardError as e:
            return e
        api_key, authorization = headers.get(b"x-api-key"), headers.get(b"authorization")
        key_header = api_key or authorization
        if ingress.principals:
            given = (api_key.decode("latin-1") if api_key else (authorization or b"").decode("latin-1").removeprefix("Bearer ")).strip()
            found = identify(given, ingress.principals) if given else None
            if found is None:
                if not self._routed(scope):
                    return None  # its 404 / 405, which reads no body
                return OrchardError("invalid_api_key", "a valid API key is required (Authorization: Bearer ... or x-api-key)")
            scope[PRINCIPAL] = found
        else:
            scope[PRINCIPAL] = OPEN
        if scope["method"] == "POST" and key_header is None and not _is_json(headers.get(b"content-type")) and self._routed(scope):
            return OrchardError(
                "unsupported_media_type",
                "a POST needs Content-Type: application/json, or an Authorization / x-api-key header (any value when no keys are "
                "configured; multipart uploads need one): a web page cannot send either to another site without asking",
            )
        return None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes], e: OrchardError) -> None:
        response = error_response(protocol_of(route_path(scope)), e)
        if headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
            response.headers["connection"] = "close"  # its body is never read: do not keep the connection to drain it
        await response(scope, receive, send)


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))
