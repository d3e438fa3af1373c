"""The HTTP surface without a cluster: FastAPI's TestClient against the real app, with an ingress
whose residency handle is None (any request that got past the check under test would fail it).
Keys, errors in each protocol's own format for every route (unknown ones and wrong methods
included), typed bodies in openapi.json, and ray-config args that fail at build time by name."""

import sys

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from router.api.app import app
from router.api.builder import validate_args
from router.api.ingress import Ingress
from router.api.keys import KeyEntry, digest, resolve
from router.api.routes import console

KEY = "sk-orchard"
USER_KEY = "sk-team-a"


def keys() -> list:
    return resolve(
        [
            KeyEntry(name="ops", role="admin", key_sha256=digest(KEY)),
            KeyEntry(name="team-a", role="user", key_env="TEAM_A_KEY", models=("llama-10m",)),
        ],
        environ={"TEAM_A_KEY": USER_KEY},
    )


BODY = {"model": "llama-10m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", "max_tokens": 4}


@pytest.fixture
def client():
    Ingress(None, principals=keys())  # installs itself as the routes' ingress
    return TestClient(app, raise_server_exceptions=False)


def routes() -> list[tuple[str, str]]:
    """(method, path) of every API route (FastAPI keeps included routers as groups)."""
    found: list[tuple[str, str]] = []

    def walk(items):
        for r in items:
            if hasattr(r, "original_router"):
                walk(r.original_router.routes)
            elif isinstance(r, APIRoute):
                found.extend((method, r.path) for method in sorted(r.methods))

    walk(app.routes)
    return found


def concrete(path: str) -> str:
    return path.replace("{model:path}", "llama-10m").replace("{model}", "llama-10m")


def assert_protocol_error(response, status: int, path: str, *, openai_code: str | None = None, anthropic_type: str | None = None):
    assert response.status_code == status, (path, response.text)
    assert response.headers["content-type"].startswith("application/json"), path
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (path, body)
        if anthropic_type:
            assert body["error"]["type"] == anthropic_type, (path, body)
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, (path, body)
        if openai_code:
            assert body["error"]["code"] == openai_code, (path, body)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_route_wants_a_valid_key(client, key):
    found = routes()
    assert {p for _, p in found} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/speech",
        "/v1/models",
        "/v1/models/{model:path}",
        "/v1/cluster",
        "/v1/cluster/events",
        "/v1/models/{model}/load",
        "/v1/models/{model}/pin",
        "/v1/models/{model}/pull",
        "/v1/models/{model}/files",
    }
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    for method, path in found:
        if path in ("/health", "/ready") or path in console.KEYLESS_PATHS:  # load balancers; the console page's own files (no data)
            continue
        r = client.request(method, concrete(path), headers=headers, json=BODY if method == "POST" else None)
        assert_protocol_error(r, 401, path, openai_code="invalid_api_key", anthropic_type="authentication_error")


ADMIN_ROUTES = [
    ("POST", "/v1/models/llama-10m/load"),
    ("POST", "/v1/models/llama-10m/unload"),
    ("POST", "/v1/models/llama-10m/pin"),
    ("POST", "/v1/models/llama-10m/unpin"),
    ("POST", "/v1/models/llama-10m/pull"),
    ("DELETE", "/v1/models/llama-10m/files?node=head"),
]


def test_a_user_key_is_refused_on_every_admin_route(client):
    user = {"authorization": f"Bearer {USER_KEY}"}
    for method, path in ADMIN_ROUTES:
        assert_protocol_error(client.request(method, path, headers=user), 403, path, openai_code="permission_denied")
    for path in ("/v1/cluster", "/v1/cluster/events"):
        assert_protocol_error(client.get(path, headers=user), 403, path, openai_code="permission_denied")
    assert client.get("/v1/cluster", headers=user).json()["error"]["type"] == "permission_error"


def test_a_user_key_limited_to_some_models_gets_a_404_for_the_others(client):
    user = {"authorization": f"Bearer {USER_KEY}", "x-api-key": USER_KEY}
    for path, body in [
        ("/v1/chat/completions", {"model": "big-secret", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"model": "big-secret", "prompt": "x"}),
        ("/v1/embeddings", {"model": "big-secret", "input": "x"}),
        ("/v1/messages", {"model": "big-secret", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = client.post(path, headers=user, json=body)
        assert_protocol_error(r, 404, path, openai_code="model_not_found", anthropic_type="not_found_error")
        assert "not in the registry" in (r.json()["error"]["message"])  # worded as for a model that does not exist
    assert_protocol_error(client.get("/v1/models/big-secret", headers=user), 404, "/v1/models/big-secret", openai_code="model_not_found")


def test_health_needs_no_key_and_ready_says_when_the_controller_is_gone(client):
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/ready")  # the residency handle here is None: the controller cannot answer
    assert_protocol_error(r, 503, "/ready", openai_code="not_ready")
    assert r.headers["retry-after"]


def test_keys_are_never_plain_and_resolve_to_hashes():
    with pytest.raises(ValueError, match="exactly one of key_env"):
        KeyEntry(name="x")
    with pytest.raises(ValueError):
        KeyEntry(name="x", key_sha256="not-a-hash")
    with pytest.raises(ValueError, match="TEAM_B_KEY is not set"):
        resolve([KeyEntry(name="b", key_env="TEAM_B_KEY")], environ={})
    principals = keys()
    assert USER_KEY not in repr(principals) and KEY not in repr(principals)
    assert [p.key_sha256 for p in principals] == [digest(KEY), digest(USER_KEY)]


def test_anthropic_clients_send_x_api_key_and_no_keys_means_open(client):
    r = client.post("/v1/messages", headers={"x-api-key": KEY}, json={"model": "m"})
    assert_protocol_error(r, 400, "/v1/messages", anthropic_type="invalid_request_error")  # past the key check: the body is bad
    Ingress(None, principals=[])
    r = client.post("/v1/chat/completions", json={"model": "m"})
    assert_protocol_error(r, 400, "/v1/chat/completions", openai_code="missing_required_parameter")
    assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("path", ["/v1/nope", "/nope", "/v1/chat/completions/extra", "/v1/messages/nope", "/v1/modelz/m/load"])
def test_unknown_routes_are_404_in_the_protocols_format(client, path):
    assert_protocol_error(client.post(path, json={}), 404, path, openai_code="route_not_found", anthropic_type="not_found_error")


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("GET", "/v1/messages"), ("PUT", "/v1/cluster")])
def test_wrong_methods_are_405_in_the_protocols_format(client, method, path):
    assert_protocol_error(client.request(method, path), 405, path, openai_code="method_not_allowed")


def test_bad_json_and_bad_fields_are_400s_naming_the_problem(client):
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = client.post("/v1/chat/completions", headers=auth, content=b'{"model": ')
    assert_protocol_error(r, 400, "/v1/chat/completions", openai_code="invalid_json")
    r = client.post("/v1/chat/completions", headers=auth, json={"model": "m", "messages": [], "temperature": "hot"})
    assert_protocol_error(r, 400, "/v1/chat/completions")
    assert r.json()["error"]["param"] in ("messages", "temperature")
    r = client.post("/v1/messages", headers=auth, content=b"[1, 2]")
    assert_protocol_error(r, 400, "/v1/messages", anthropic_type="invalid_request_error")
    r = client.get("/v1/cluster/events?since=-3", headers=auth)
    assert_protocol_error(r, 400, "/v1/cluster/events")
    assert r.json()["error"]["param"] == "since"


def test_openapi_declares_a_typed_body_for_every_post():
    spec = TestClient(app).get("/openapi.json").json()
    bodiless = {"/v1/models/{model}/unload", "/v1/models/{model}/pin", "/v1/models/{model}/unpin"}  # actions without a body
    for path, operations in spec["paths"].items():
        post = operations.get("post")
        if post is None or path in bodiless:
            continue
        content = post.get("requestBody", {}).get("content", {})
        assert content, f"POST {path} declares no request body"
        schema = next(iter(content.values()))["schema"]
        assert "$ref" in schema or "anyOf" in schema or "properties" in schema, (path, schema)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"model", "messages", "stream", "tools", "response_format", "max_tokens"} <= set(chat)


@pytest.mark.parametrize(
    "args,field",
    [
        ({"models": [{"name": "a", "kind": "diffusion", "weight_bytes": "1GiB"}]}, "models[0] (a).kind"),
        ({"models": [{"name": "é", "kind": "llm", "weight_bytes": "1GiB"}]}, "models[0] (é).name"),
        ({"models": [{"name": "a", "kind": "llm", "weight_bytes": "1GiB", "pinned": "sometimes"}]}, "models[0] (a).pinned"),
        ({"models": [{"name": "a", "kind": "llm", "weight_bytes": "1GiB", "tool_parser": "nope"}]}, "models[0] (a).tool_parser"),
        ({"models": [], "policy": {"max_loaded_models": 2}}, "args.policy.max_loaded_models"),
        ({"models": [], "chunk_timeout_s": -1}, "args.chunk_timeout_s"),
        ({"models": [], "ingress_gil_switch_ms": 0}, "args.ingress_gil_switch_ms"),
        ({"models": [{"name": "a", "kind": "llm", "weight_bytes": "1GiB", "llm_engine": {"hold": 1}}]}, "models[0] (a).llm_engine"),
        ({"models": [{"name": "a", "kind": "llm", "weight_bytes": "1GiB", "llm_engine": {"prefill_batch": 0}}]}, "prefill_batch"),
        ({"models": [{"name": "e", "kind": "embedding", "weight_bytes": "1GiB", "llm_engine": {}}]}, "models[0] (e).llm_engine"),
        ({"models": [], "coalesce_token": 4}, "args.coalesce_token"),
        ({"models": [], "overrides": {"ghost": {"pinned": True}}}, "overrides: no model ghost"),
        ({"models": [], "api_keys": ["sk-plain"]}, "args.api_keys.0"),
        ({"models": [], "api_keys": [{"name": "a", "key_sha256": "0" * 64, "models": ["ghost"]}]}, "api_keys[0] (a).models: no model ghost"),
    ],
)
def test_config_errors_fail_the_build_naming_the_field(args, field):
    with pytest.raises(ValueError) as info:
        validate_args(args)
    assert field in str(info.value)


@pytest.mark.parametrize(
    "path,body",
    [  # found by schemathesis: a list where a block type goes was an unhashable-type 500
        ("/v1/messages", {"max_tokens": 1, "messages": [{"content": [{"type": []}], "role": "user"}], "model": "m", "system": [{"type": []}]}),
        ("/v1/responses", {"model": "m", "input": [{"type": []}], "tools": [{"type": []}], "tool_choice": {"type": []}}),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [{"type": {}}]}], "text": {"format": {"type": []}}}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": []}]}], "tools": [{"type": []}]}),
    ],
)
def test_malformed_type_fields_are_400s(client, path, body):
    r = client.post(path, headers={"authorization": f"Bearer {KEY}"}, json=body)
    assert_protocol_error(r, 400, path)


def test_ingress_gil_switch_ms_sets_the_replicas_switch_interval_and_none_leaves_pythons():
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        Ingress(None, principals=keys())
        assert sys.getswitchinterval() == pytest.approx(0.005)  # None (the default): Python's own
        Ingress(None, principals=keys(), gil_switch_ms=0.25)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        sys.setswitchinterval(saved)
        Ingress(None, principals=keys())


def test_a_registry_entrys_llm_engine_keeps_only_what_it_sets():
    from router.residency.registry import from_config

    entry = {"name": "a", "kind": "llm", "weight_bytes": "1GiB", "path": "/nowhere", "llm_engine": {"admit_hold_steps": 0}}
    _, entries = from_config([entry, {"name": "b", "kind": "llm", "weight_bytes": "1GiB", "path": "/nowhere"}], "models")
    assert entries["a"].llm_engine == {"admit_hold_steps": 0}  # the rest stays the app's
    assert entries["b"].llm_engine is None
