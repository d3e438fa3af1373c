"""With API keys configured, every endpoint of the ingress refuses a request without a valid key,
in OpenAI's error format, before it reaches the cluster (the residency handle here is None: any
call past the key check would fail the test)."""

import asyncio
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


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_endpoint_wants_a_valid_key(key):
    ingress = UserIngress(None, api_keys=["sk-orchard"])
    calls = [
        lambda r: ingress.list_models(r),
        lambda r: ingress.cluster(r),
        lambda r: ingress.events(r),
        lambda r: ingress.model_action(r, "llama-10m", "load"),
        lambda r: ingress.chat_completions(r),
        lambda r: ingress.completions(r),
        lambda r: ingress.embeddings(r),
    ]
    body = {"model": "llama-10m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
    for call in calls:
        response = asyncio.run(call(request("/v1/x", key, body)))
        assert response.status_code == 401
        err = json.loads(response.body)["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"


def test_the_right_key_passes_and_no_keys_means_open():
    assert UserIngress(None, api_keys=["sk-orchard"])._authorized(request("/v1/models", "sk-orchard"))
    assert UserIngress(None)._authorized(request("/v1/models"))
