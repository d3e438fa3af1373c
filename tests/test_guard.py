"""The app's door (router/api/guard.py) at the ASGI level, on the real app with an ingress whose
residency is a plain fake: what is refused from the headers alone, before the body is read (the
client's body here never arrives unless a test sends it), and what gets through. Issue 25 items 3
(key and size before the body) and 9 (Host, cross-site POSTs, loopback without an admin key)."""

import asyncio
import json
from typing import Any

import pytest

from router.api import builder, guard
from router.api.app import app
from router.api.ingress import Ingress
from router.api.keys import KeyEntry, digest, resolve

ADMIN, USER = "sk-admin", "sk-user"
LIMIT, AUDIO_LIMIT = 1024, 4096


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def answer():
            return self.fn(*args)

        return answer()


class FakeResidency:
    """Only what the routes below ask of the residency service."""

    def __init__(self):
        self.unloaded: list[str] = []
        self.unload = _Method(lambda model: self.unloaded.append(model) or {"model": model, "unloaded": True})
        self.models = _Method(lambda: [{"id": "llama-10m"}])


def principals(keys: bool) -> list:
    if not keys:
        return []
    return resolve(
        [
            KeyEntry(name="ops", role="admin", key_sha256=digest(ADMIN)),
            KeyEntry(name="team", role="user", key_sha256=digest(USER), models=("llama-10m",), rpm=5),
        ]
    )


@pytest.fixture
def door():
    """Configure the app as a deployment would (keys or none); back to unconfigured after."""

    def install(keys: bool = True) -> FakeResidency:
        residency = FakeResidency()
        Ingress(residency, principals=principals(keys), max_audio_bytes=AUDIO_LIMIT)
        guard.configure(
            guard.GuardSettings(max_request_bytes=LIMIT, max_audio_bytes=AUDIO_LIMIT, allowed_hosts=frozenset({"orchard.example", "*.corp.example"}))
        )
        return residency

    yield install
    guard.configure(None)
    Ingress(None)


def call(method: str, path: str, headers: dict[str, str], chunks: list[bytes] | None = None, timeout: float = 2.0) -> dict[str, Any]:
    """The app's answer to a request whose body is `chunks` (then the client goes quiet: a read past
    them waits forever, as for a client that promised more); how many body bytes the app read."""
    state: dict[str, Any] = {"read": 0, "messages": []}
    pending = list(chunks or [])

    async def receive():
        if not pending:
            await asyncio.Event().wait()  # a client that never sends (the rest of) its body
        chunk = pending.pop(0)
        state["read"] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending) or chunks is None}

    async def send(message):
        state["messages"].append(message)

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in ({"host": "127.0.0.1:8000"} | headers).items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def run():
        await asyncio.wait_for(app(scope, receive, send), timeout)

    asyncio.run(run())
    start = next(m for m in state["messages"] if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in state["messages"] if m["type"] == "http.response.body")
    return {
        "status": start["status"],
        "headers": {k.decode(): v.decode() for k, v in start["headers"]},
        "json": json.loads(body or b"null"),
        "read": state["read"],
    }


JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"


def test_a_keyless_request_promising_a_huge_body_is_a_401_before_a_byte_is_read(door):
    door(keys=True)
    r = call("POST", CHAT, JSON | {"content-length": str(10**12)})  # the body never comes
    assert r["status"] == 401 and r["json"]["error"]["code"] == "invalid_api_key"
    assert r["read"] == 0 and r["headers"]["connection"] == "close"
    r = call("POST", "/v1/messages", JSON | {"transfer-encoding": "chunked", "x-api-key": "wrong"})  # a slow chunked body
    assert r["status"] == 401 and r["json"]["type"] == "error" and r["read"] == 0  # Anthropic's format under /v1/messages


def test_a_content_length_over_the_routes_limit_is_a_413_before_reading(door):
    door(keys=True)
    r = call("POST", CHAT, JSON | {"authorization": f"Bearer {USER}", "content-length": str(LIMIT + 1)})
    assert r["status"] == 413 and r["json"]["error"]["code"] == "request_too_large" and "max_request_bytes" in r["json"]["error"]["message"]
    assert r["read"] == 0
    # the upload route's limit is max_audio_bytes (and room for the form's fields), not max_request_bytes
    multipart = {"authorization": f"Bearer {USER}", "content-type": "multipart/form-data; boundary=x"}
    r = call("POST", "/v1/audio/transcriptions", multipart | {"content-length": str(AUDIO_LIMIT + guard.MULTIPART_ROOM + 1)})
    assert r["status"] == 413 and "max_audio_bytes" in r["json"]["error"]["message"] and r["read"] == 0
    r = call("POST", CHAT, JSON | {"authorization": f"Bearer {USER}", "content-length": str(LIMIT)}, [b" " * LIMIT])
    assert r["status"] == 400  # at the limit: read, and refused for what it says (blank JSON), not its size


def test_a_chunked_body_is_cut_off_at_the_limit(door):
    door(keys=True)
    chunks = [b"x" * 256] * 100  # 25 KiB promised in pieces, no Content-Length
    r = call("POST", CHAT, JSON | {"authorization": f"Bearer {ADMIN}", "transfer-encoding": "chunked"}, chunks)
    assert r["status"] == 413 and r["headers"]["connection"] == "close", r
    assert r["json"]["error"]["code"] == "request_too_large", r  # the same code as a Content-Length refused at the door
    assert LIMIT < r["read"] <= LIMIT + 256  # it stopped reading at the first chunk past the limit


def test_unknown_host_names_are_refused(door):
    door(keys=True)
    admin = {"authorization": f"Bearer {ADMIN}"}
    r = call("GET", "/v1/models", admin | {"host": "evil.example:8000"})
    assert r["status"] == 421 and r["json"]["error"]["code"] == "host_not_allowed"
    assert call("GET", "/health", {"host": "rebind.evil.example"})["status"] == 421
    for host in ["localhost:8000", "127.0.0.1", "127.0.0.2:30000", "[::1]:8000", "10.1.2.3:8000", "orchard.example", "api.corp.example:443"]:
        assert call("GET", "/v1/models", admin | {"host": host})["status"] == 200, host


def test_host_names_parse():
    assert guard.host_name("[::1]:8000") == "::1" and guard.host_name("Mac-1.Local.:8000") == "mac-1.local" and guard.host_name("::1") == "::1"
    assert guard.host_allowed("anything", frozenset({"*"})) and not guard.host_allowed("corp.example", frozenset({"*.corp.example"}))


def test_without_keys_a_cross_site_simple_post_reaches_no_state_changing_route(door):
    residency = door(keys=False)
    unload = "/v1/models/llama-10m/unload"
    for headers, body in [
        ({"content-type": "text/plain"}, b"{}"),
        ({"content-type": "application/x-www-form-urlencoded"}, b"a=1"),
        ({}, b""),  # a bodiless POST, as fetch(url, {method: "POST", mode: "no-cors"}) sends
    ]:
        r = call("POST", unload, headers | {"content-length": str(len(body)), "origin": "https://evil.example"}, [body])
        assert r["status"] == 415 and r["json"]["error"]["code"] == "unsupported_media_type", headers
    multipart = {"content-type": "multipart/form-data; boundary=x", "content-length": "10"}
    assert call("POST", "/v1/audio/transcriptions", multipart, [b"--x--\r\n\r\n"])["status"] == 415
    r = call("POST", CHAT, {"content-type": "text/plain", "content-length": "2"}, [b"{}"])
    assert r["status"] == 415
    assert residency.unloaded == []
    # what a page cannot send cross-site without a CORS preflight (never granted) gets through
    assert call("POST", unload, JSON | {"content-length": "0"}, [b""])["status"] == 200
    assert call("POST", unload, {"authorization": "Bearer anything"}, [b""])["status"] == 200
    assert residency.unloaded == ["llama-10m", "llama-10m"]
    assert call("POST", "/v1/nope", {"content-type": "text/plain"}, [b""])["status"] == 404  # no route: its 404, not a 415


def test_the_principal_the_door_found_is_the_routes(door):
    door(keys=True)
    r = call("POST", "/v1/models/llama-10m/unload", {"x-api-key": USER}, [b""])
    assert r["status"] == 403 and "'team' is a user key" in r["json"]["error"]["message"]
    r = call("GET", "/v1/models", {"authorization": f"Bearer {USER}"})
    assert r["status"] == 200 and [m["id"] for m in r["json"]["data"]] == ["llama-10m"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "mac-1.local"])
def test_build_app_refuses_another_address_than_loopback_without_an_admin_key(monkeypatch, host):
    monkeypatch.setattr(builder, "serve_http_host", lambda: host)
    user_only = [{"name": "team", "role": "user", "key_sha256": digest(USER)}]
    for keys in ([], user_only):
        with pytest.raises(ValueError, match="not a loopback address.*no admin key is configured"):
            builder.build_app({"models": [], "api_keys": keys})
    builder.build_app({"models": [], "api_keys": [{"name": "ops", "role": "admin", "key_sha256": digest(ADMIN)}]})


@pytest.mark.parametrize("host", [None, "127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_build_app_serves_loopback_without_keys(monkeypatch, host):
    monkeypatch.setattr(builder, "serve_http_host", lambda: host)
    builder.build_app({"models": []})
