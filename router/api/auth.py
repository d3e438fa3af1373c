"""API keys: one FastAPI dependency on every route. OpenAI clients send `Authorization: Bearer
<key>`, Anthropic clients `x-api-key: <key>`; keys compare in constant time. No keys configured
means the app is open (the embedded default, on 127.0.0.1)."""

import hmac

from fastapi import Depends, Request

from router.api.ingress import Ingress, current
from router.errors import OrchardError


def require_key(request: Request, ingress: Ingress = Depends(current)) -> None:
    if not ingress.api_keys:
        return
    given = (request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")).strip().encode()
    if not any(hmac.compare_digest(given, key) for key in ingress.api_keys):
        raise OrchardError("invalid_api_key", "a valid API key is required (Authorization: Bearer ... or x-api-key)")
