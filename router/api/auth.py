"""Who may call what: one dependency on every route (the key's principal), one more on the operator's
routes (the role). OpenAI clients send `Authorization: Bearer <key>`, Anthropic clients
`x-api-key: <key>`. No keys configured means the app is open (served on loopback only: the app
builder refuses another address without an admin key).

The key itself is checked in one place, at the app's door before the body is read
(router/api/guard.py); the dependency here only reads the principal the guard found, and refuses
a request the guard let through without one.

A user key restricted to some models gets a 404 for any other model, exactly as for a model that
does not exist, so model names do not leak (`Ingress.hold` and the model list check it).

The dependencies are `async def` although they never await: FastAPI runs a plain `def` dependency
in its thread pool, a hop to a worker thread and back for every request, which under load waited
for the GIL behind the event loop (docs/serve-path.md, "Transport")."""

from fastapi import Depends, Request

from deployments.wire.failure import OrchardError
from router.api.guard import principal_of
from router.api.keys import Principal


async def principal(request: Request) -> Principal:
    found = principal_of(request.scope)
    if found is None:
        raise OrchardError("invalid_api_key", "a valid API key is required (Authorization: Bearer ... or x-api-key)")
    return found


async def require_admin(who: Principal = Depends(principal)) -> Principal:
    if not who.admin:
        raise OrchardError("permission_denied", f"key {who.name!r} is a user key: this route needs an admin key")
    return who
