"""Issue 25 items 4-6 on a running cluster (the shared one-node cluster, real models, HTTP), with an
admin key and scoped user keys: a streaming client that stops reading does not keep its lease (a
key with limits: its own lease; a key without: the ingress's standing lease), and the response it
does not read is ended, its connection reset, on the write timeout; a key's tpm counts the prompt
at admission and what embeddings use; a user key's 503 names its own model only, while an admin
key's says which models, nodes and bytes stand in the way."""

import errno
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
    "open": "sk-sec-open",  # llama-10m only, no limits: its requests share the ingress's standing lease
}
EMBEDDING = "all-minilm-l6-v2"
WRITE_TIMEOUT_S = 15.0  # the app's stream_write_timeout_s (30 s served)


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
        key_entry("open", KEYS["open"], models=["llama-10m"]),
    ]
    policy = {"min_residency_s": 0, "residency_per_reload": 0, "instance_overhead_bytes": 32 * MIB, "contention": "fail"}
    args = {
        "models_dir": str(models_dir),
        "models": models,
        "policy": policy,
        "api_keys": api_keys,
        "watch_period_s": 0.5,
        "stream_write_timeout_s": WRITE_TIMEOUT_S,
    }
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


def _stalled_chat(host: str, port: str, key: str, body: dict) -> socket.socket:
    """A streamed chat from a client with a 4 KB receive buffer (default MSS) that reads the
    response's headers and then nothing; its socket."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEYS[key]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it offers
    stalled.connect((host, int(port)))
    stalled.sendall(head + data)
    headers = b""
    while b"\r\n\r\n" not in headers:  # byte by byte: nothing of the body is read
        byte = stalled.recv(1)
        assert byte, headers
        headers += byte
    assert headers.startswith(b"HTTP/1.1 200"), headers
    return stalled


def _instance(orchard, model: str) -> dict | None:
    nodes = requests.get(orchard["base"] + "/v1/cluster", headers=auth("ops"), timeout=30).json()["nodes"]
    return next((i for n in nodes for i in n["instances"] if i["model"] == model), None)


def test_a_stream_nobody_reads_ends_its_lease_with_its_generation_and_is_reset_on_the_write_timeout(orchard):
    """A user's report: a streamed chat on the ingress replica's own port, by a key without limits
    (its requests share the replica's standing lease, counted in flight there), whose client set a
    4 KB receive buffer and read the headers, then nothing, kept a lease on its instance long after
    its generation's end, until the client closed its socket. Over loopback's default MSS the
    server's kernel takes about 2.8 MB before a write blocks, so the stream (~1.6 KB a token) is
    made to outgrow that. Now: once its generation ends, the instance's in-flight count drops and
    the standing lease goes back while the connection is still open, so the model can be unloaded
    under it; and the write the client never takes ends the response on the write timeout, its
    connection reset (it was held open, with what the server had buffered, until the client closed)."""
    ok = post(orchard, "/v1/completions", {"model": "llama-10m", "prompt": "x", "max_tokens": 2}, "open")
    assert ok.status_code == 200, ok.text
    host, port = direct_url(orchard).removeprefix("http://").split(":")
    body = {
        "model": "llama-10m",
        "messages": [{"role": "user", "content": "Go on"}],
        "max_tokens": 2200,  # ~3.5 MB of SSE
        "logit_bias": NEVER_END,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    stalled = _stalled_chat(host, port, "open", body)
    started = time.monotonic()

    def reset() -> int:
        return stalled.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # the pending error, without reading

    try:
        running = _instance(orchard, "llama-10m")
        routing = requests.get(orchard["base"] + "/v1/cluster", headers=auth("ops"), timeout=30).json()["routing"]
        assert running is not None and running["leases"] == 1 and running["in_flight"] >= 1, running
        assert routing["standing_leases"] == 1 and routing["request_leases"] == 0, routing  # the standing-lease path
        while True:  # the generation runs, then ends: its count and the standing lease go, the socket still open
            time.sleep(0.25)
            error = reset()
            assert error == 0, f"the connection was reset ({errno.errorcode.get(error)}) before the instance's lease ended"
            instance = _instance(orchard, "llama-10m")
            assert instance is not None, "the instance went away under the stream"
            if instance["leases"] == 0 and instance["in_flight"] == 0:
                break
            assert time.monotonic() - started < 90, f"the stream that is not read still holds its instance: {instance}"
        freed_s = time.monotonic() - started
        r = post(orchard, "/v1/models/llama-10m/unload", {}, "ops")  # nothing holds it: an eviction could take it now
        assert r.status_code == 200 and r.json()["unloaded_from"] == ["head"], r.text
        assert reset() == 0, "the unload waited for the stream's connection"
        while (error := reset()) == 0:  # the write it never takes: the response ends and its connection is reset
            time.sleep(0.25)
            assert time.monotonic() - started < freed_s + WRITE_TIMEOUT_S + 20, "the response nobody reads was not ended"
        assert error == errno.ECONNRESET, errno.errorcode.get(error)
        assert time.monotonic() - started > WRITE_TIMEOUT_S  # by the write timeout, not before
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
