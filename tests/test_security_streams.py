"""Issue 25 items 4-6 on a running cluster (the shared one-node cluster, real models, HTTP), with an
admin key and scoped user keys: a streaming client that stops reading does not keep its lease; a
key's tpm counts the prompt at admission and what embeddings use; a user key's 503 names its own
model only, while an admin key's says which models, nodes and bytes stand in the way."""

import json
import socket
import time

import pytest
import requests

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from support.cluster import key_entry, serve_orchard  # noqa: E402

from router.residency.registry import from_manifest  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): streams run to max_tokens
KEYS = {
    "ops": "sk-sec-admin",
    "team-a": "sk-sec-team-a",  # llama-10m only, rpm 5
    "solo": "sk-sec-solo",  # one request at a time
    "frugal": "sk-sec-frugal",  # 400 tokens a minute
    "team-c": "sk-sec-team-c",  # two models that cannot be served
}
EMBEDDING = "all-minilm-l6-v2"


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray, broken_dir):
    small = {"kind": "llm", "path": "llama-10m"}
    models = from_manifest(models_dir) + [
        {"name": "llama-pinned", "pinned": True, "weight_bytes": "4GiB"} | small,  # holds most of the 6 GiB head once loaded
        {"name": "llama-big", "weight_bytes": "4GiB"} | small,  # cannot be placed beside it
        {"name": "broken-llama", "kind": "llm", "path": str(broken_dir), "weight_bytes": "40MiB", "kv_bytes_per_token": "8KiB"},
    ]
    api_keys = [
        key_entry("ops", KEYS["ops"], "admin"),
        key_entry("team-a", KEYS["team-a"], models=["llama-10m"], rpm=5),
        key_entry("solo", KEYS["solo"], models=["llama-10m"], max_concurrent=1),
        key_entry("frugal", KEYS["frugal"], models=["llama-10m", EMBEDDING], tpm=400),
        key_entry("team-c", KEYS["team-c"], models=["llama-big", "broken-llama"]),
    ]
    policy = {"min_residency_s": 0, "residency_per_reload": 0, "instance_overhead_bytes": 32 * MIB, "contention": "fail"}
    args = {"models_dir": str(models_dir), "models": models, "policy": policy, "api_keys": api_keys, "watch_period_s": 0.5}
    yield {"base": serve_orchard(args), "broken_dir": broken_dir}
    serve.shutdown()


def post(orchard, path: str, body: dict, key: str, base: str | None = None) -> requests.Response:
    return requests.post((base or orchard["base"]) + path, json=body, headers=auth(key), timeout=120)


def direct_url(orchard) -> str:
    """The ingress replica's own address (Serve's direct ingress: no proxy between it and the client)."""
    deadline = time.time() + 30
    while True:
        ingress = requests.get(orchard["base"] + "/v1/cluster", headers=auth("ops"), timeout=30).json()["ingress"]
        if ingress or time.time() > deadline:
            assert ingress, "no direct ingress address"
            return ingress[0]["url"]
        time.sleep(0.5)


def test_a_client_that_stops_reading_does_not_keep_its_lease(orchard):
    """Issue 25 item 4: a stream whose client reads nothing (a tiny receive window, never read) made
    the response's writes block, and with them the generation's end and its lease: the instance
    could not be evicted and the key's one slot stayed taken. The lease ends with the generation."""
    small = {"model": "llama-10m", "prompt": "x", "max_tokens": 2}
    assert post(orchard, "/v1/completions", small, "solo").status_code == 200  # loaded, and the key's slot free
    host, port = direct_url(orchard).removeprefix("http://").split(":")
    # ~1.6 KB of SSE per token (20 top logprobs each): 600 KB, far more than the socket buffers take
    body = json.dumps(
        {
            "model": "llama-10m",
            "messages": [{"role": "user", "content": "Go on"}],
            "max_tokens": 400,
            "logit_bias": NEVER_END,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEYS['solo']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    stalled = socket.socket()
    # before connecting: the window stays shut, and the small segments keep the server's send buffer
    # small too (over loopback's 64 KiB segments, Linux grows it to 4 MiB: the whole answer would fit)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    stalled.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    stalled.connect((host, int(port)))
    try:
        stalled.sendall(head + body)
        started = time.monotonic()
        refused = 0
        while True:  # the key's one slot is the stream's until its lease ends
            time.sleep(1.0)
            r = post(orchard, "/v1/completions", small, "solo")
            if r.status_code == 200:
                break
            assert r.status_code == 429 and "max_concurrent" in r.json()["error"]["message"], r.text
            refused += 1
            assert time.monotonic() - started < 40, "the stream that is not read still holds the key's slot"
        assert refused >= 1  # the stream did run while it held the slot
        # and no lease is left behind by the stream (the last request's own release is sent detached)
        for _ in range(20):
            routing = requests.get(orchard["base"] + "/v1/cluster", headers=auth("ops"), timeout=30).json()["routing"]
            if routing["request_leases"] == 0:
                break
            time.sleep(0.25)
        assert routing["request_leases"] == 0, routing
    finally:
        stalled.close()


def test_a_keys_tpm_counts_the_prompt_and_embeddings(orchard):
    """Issue 25 item 5: 400 tokens a minute. A long prompt with max_tokens 5 passed on its max_tokens
    alone; now its prompt counts at admission. Embeddings were never charged; now their tokens count."""
    long_prompt = {"model": "llama-10m", "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 5}
    r = post(orchard, "/v1/chat/completions", long_prompt, "frugal")
    assert r.status_code == 429 and "tpm is 400" in r.json()["error"]["message"], r.text
    texts = {"model": EMBEDDING, "input": ["the quick brown fox jumps over the lazy dog"] * 20}
    first = post(orchard, "/v1/embeddings", texts, "frugal")
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["prompt_tokens"]
    assert used > 100
    second = post(orchard, "/v1/embeddings", texts, "frugal")  # what the first used + this one's estimate > 400
    assert second.status_code == 429 and "tpm is 400" in second.json()["error"]["message"], second.text
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 400 - used  # the first is counted at its real usage


def _error(r: requests.Response) -> tuple[int, str, str]:
    e = r.json()["error"]
    return r.status_code, e["code"], e["message"]


def test_a_user_keys_503_names_its_own_model_only(orchard):
    """Issue 25 item 6: a user key's model cannot be placed (a pinned model holds the node) or fails
    to load (its weights are truncated): its 503 says so without other models, nodes, bytes or
    paths; the admin key's says which and how much; the events keep the details."""
    r = post(orchard, "/v1/models/llama-pinned/load", {}, "ops")
    assert r.status_code == 200, r.text
    ask = {"model": "llama-big", "prompt": "x", "max_tokens": 2}
    status, code, message = _error(post(orchard, "/v1/completions", ask, "team-c"))
    assert (status, code) == (503, "model_blocked") and "llama-big" in message, message
    assert "llama-pinned" not in message and "head" not in message and "GiB" not in message, message
    status, code, message = _error(post(orchard, "/v1/completions", ask, "ops"))
    assert (status, code) == (503, "model_blocked") and "llama-pinned" in message and "head" in message and "GiB" in message, message

    broken = {"model": "broken-llama", "prompt": "x", "max_tokens": 2}
    status, code, message = _error(post(orchard, "/v1/completions", broken, "team-c"))
    assert status == 503 and "broken-llama" in message, message
    assert "/" not in message and "head" not in message, message
    status, _, message = _error(post(orchard, "/v1/completions", broken, "ops"))
    assert status == 503 and "head" in message, message
    events = requests.get(orchard["base"] + "/v1/cluster/events", headers=auth("ops"), timeout=30).json()["data"]
    assert any(e["kind"] == "rejected" and e["model"] == "llama-big" and "llama-pinned" in e["reason"] for e in events), events
    assert any(e["kind"] == "load_failed" and e["model"] == "broken-llama" for e in events), events

    # a user key asking for a model not its own learns nothing either; its own model still serves
    r = post(orchard, "/v1/completions", ask, "team-a")
    assert r.status_code == 404 and "llama-pinned" not in r.text
    r = post(orchard, "/v1/completions", {"model": "llama-10m", "prompt": "x", "max_tokens": 2}, "team-a")
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "5"
