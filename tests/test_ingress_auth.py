"""With API keys configured, every endpoint of the ingress refuses a request without a valid key,
in OpenAI's error format, before it reaches the cluster (the residency handle here is None: any
call past the key check would fail the test)."""

import asyncio
import inspect
import json

import pytest
from starlette.requests import Request

from router import app as router_app

UserIngress = router_app.Ingress.func_or_class.__mro__[1]  # the class under Serve's ASGI wrapper


def request(path: str, key: str | None = None, body: dict | None = None) -> Request:
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    payload = json.dumps(body or {}).encode()

    async def receive():
        return {"type": "http.request", "body": payload, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}, receive)


def _endpoints() -> dict[str, str]:
    """Every route of the app: method name -> path (so a new endpoint cannot miss the check)."""
    found: dict[str, str] = {}

    def walk(routes):
        for r in routes:
            if hasattr(r, "original_router"):  # FastAPI groups included routers
                walk(r.original_router.routes)
            elif hasattr(UserIngress, getattr(r, "name", "")):
                found[r.name] = r.path

    walk(router_app.app.routes)
    return found


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_endpoint_wants_a_valid_key(key):
    ingress = UserIngress(None, api_keys=["sk-orchard"])
    endpoints = _endpoints()
    assert {"chat_completions", "messages", "count_tokens", "responses", "rerank", "transcriptions", "speech", "embeddings"} <= set(endpoints)
    body = {"model": "llama-10m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", "max_tokens": 4}
    for name, path in endpoints.items():
        params = {p: "llama-10m" if p == "model" else "load" for p in inspect.signature(getattr(UserIngress, name)).parameters if p in ("model", "action")}
        response = asyncio.run(getattr(ingress, name)(request(path, key, body), **params))
        assert response.status_code == 401, name
        body_ = json.loads(response.body)
        if path.startswith("/v1/messages"):  # Anthropic's format
            assert body_["type"] == "error" and body_["error"]["type"] == "authentication_error", name
        else:
            assert body_["error"]["code"] == "invalid_api_key" and body_["error"]["type"] == "authentication_error", name


def test_anthropic_clients_send_x_api_key():
    r = request("/v1/messages")
    r.scope["headers"].append((b"x-api-key", b"sk-orchard"))
    assert UserIngress(None, api_keys=["sk-orchard"])._authorized(r)


def test_the_right_key_passes_and_no_keys_means_open():
    assert UserIngress(None, api_keys=["sk-orchard"])._authorized(request("/v1/models", "sk-orchard"))
    assert UserIngress(None)._authorized(request("/v1/models"))
