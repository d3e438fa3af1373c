"""Residency over time, end to end on a real 2-node Ray cluster through HTTP, with API keys on:
idle timeout, a load that waits behind an open stream, a frozen instance cut off by the ingress's
per-item timeout, and a restarted controller adopting the model servers that outlived it."""

import json
import os
import signal
import threading
import time

import pytest
import requests

ray = pytest.importorskip("ray")
import openai  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from cluster.placement import find_model_server  # noqa: E402
from router.api.builder import build_app  # noqa: E402
from tests.test_cluster_e2e import HEALTH, free_port, node_args  # noqa: E402

MIB = 1024**2
KEY = "sk-orchard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHUNK_TIMEOUT_S = 3.0
NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): streams run to max_tokens


@pytest.fixture(scope="module")
def orchard(models_dir):
    """Head (0.7 GiB: one 400 MiB model at a time) + mac-1 (0.3 GiB: small models only)."""
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", 0.7, 2) | {"include_dashboard": False, "_system_config": HEALTH})
    cluster.add_node(**node_args("mac-1", 0.3, 1))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    small = {"kind": "llm", "path": "llama-10m"}
    big = small | {"weight_bytes": "400MiB"}
    models = [
        {"name": "llama-10m"} | small,
        {"name": "idle-llama", "idle_ttl_s": 2} | small,
        {"name": "frozen-llama"} | small,
        {"name": "big-a"} | big,
        {"name": "big-b"} | big,
    ]
    policy = {
        "safety_margin_bytes": 16 * MIB, "safety_margin_fraction": 0, "instance_overhead_bytes": 64 * MIB,
        "min_residency_s": 0, "contention": "wait", "wait_timeout_s": 60,
    }
    args = {"models_dir": str(models_dir), "models": models, "policy": policy, "watch_period_s": 0.5, "chunk_timeout_s": CHUNK_TIMEOUT_S, "api_keys": [KEY]}
    serve.run(build_app(args), name="orchard", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    yield {"base": base, "client": client}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def get(orchard, path: str) -> dict:
    r = requests.get(orchard["base"] + path, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def instances(orchard) -> dict[str, dict]:
    return {i["model"]: i | {"node_id": n["node_id"]} for n in get(orchard, "/v1/cluster")["nodes"] for i in n["instances"]}


def events(orchard, model: str) -> list[dict]:
    return [e for e in get(orchard, "/v1/cluster/events")["data"] if e["model"] == model]


def actor(model: str, node_id: str):
    return find_model_server(model, node_id)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_every_endpoint_requires_the_key_on_a_running_cluster(orchard):
    no_key = openai.OpenAI(base_url=orchard["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        no_key.chat.completions.create(model="llama-10m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/cluster", "/v1/cluster/events"):
        r = requests.get(orchard["base"] + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = requests.post(orchard["base"] + "/v1/models/llama-10m/load", timeout=30)
    assert r.status_code == 401
    assert "llama-10m" not in instances(orchard)  # nothing was loaded by the refused calls
    reply = orchard["client"].completions.create(model="llama-10m", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_idle_model_is_unloaded_after_its_ttl(orchard):
    orchard["client"].completions.create(model="idle-llama", prompt="Hello", max_tokens=2)
    node = instances(orchard)["idle-llama"]["node_id"]
    wait_for(lambda: "idle-llama" not in instances(orchard), 20, "the idle unload")
    unloads = [e for e in events(orchard, "idle-llama") if e["kind"] == "unloaded"]
    assert unloads and "idle" in unloads[-1]["reason"]
    with pytest.raises(ValueError):  # the actor is gone, not just forgotten
        wait_for(lambda: not actor("idle-llama", node), 10, "the actor to die")
    models = {m["id"]: m["orchard"] for m in get(orchard, "/v1/models")["data"]}
    assert models["idle-llama"]["status"] == "available"


def _stream_lines(orchard, body: dict):
    r = requests.post(orchard["base"] + "/v1/completions", json=body | {"stream": True}, headers=AUTH, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    return r, (line for line in r.iter_lines() if line)


def test_a_load_waits_for_the_open_stream_that_blocks_it(orchard):
    """big-a and big-b each fit only on the head, one at a time. While big-a streams, a request for
    big-b waits (contention: wait) instead of evicting it; when the stream ends, big-a is evicted
    and big-b answers."""
    response, lines = _stream_lines(orchard, {"model": "big-a", "prompt": "Go on", "max_tokens": 4000, "logit_bias": NEVER_END})
    for _ in range(3):
        next(lines)
    assert instances(orchard)["big-a"]["node_id"] == "head"
    result: dict = {}

    def ask_b():
        started = time.monotonic()
        reply = orchard["client"].completions.create(model="big-b", prompt="Hello", max_tokens=4, temperature=0)
        result.update(seconds=time.monotonic() - started, tokens=reply.usage.completion_tokens)

    waiter = threading.Thread(target=ask_b)
    waiter.start()
    time.sleep(4)
    assert not result, "big-b answered while big-a was streaming on the only node that fits it"
    assert "big-a" in instances(orchard)  # never evicted while busy
    for _ in range(5):  # big-a still streams
        assert json.loads(next(lines).removeprefix(b"data: "))["choices"][0]["finish_reason"] is None
    response.close()  # the stream ends: big-a is idle, big-b may evict it
    waiter.join(60)
    assert result.get("tokens") == 4 and result["seconds"] >= 4
    assert "big-a" not in instances(orchard) and instances(orchard)["big-b"]["node_id"] == "head"
    assert any(e["kind"] == "evicted" for e in events(orchard, "big-a"))


def test_a_frozen_instance_ends_the_stream_after_the_inactivity_timeout(orchard):
    response, lines = _stream_lines(orchard, {"model": "frozen-llama", "prompt": "Go on", "max_tokens": 4000, "logit_bias": NEVER_END})
    next(lines)
    server = actor("frozen-llama", instances(orchard)["frozen-llama"]["node_id"])
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        last = None
        for line in lines:  # what was already in flight, then the error event
            last = json.loads(line.removeprefix(b"data: ")) if line != b"data: [DONE]" else last
            if line == b"data: [DONE]" or "error" in (last or {}):
                break
        waited = time.monotonic() - frozen_at
        assert last is not None and last["error"]["code"] == "model_unavailable" and "sent nothing" in last["error"]["message"]
        assert waited < CHUNK_TIMEOUT_S + 10, waited
    finally:
        os.kill(pid, signal.SIGCONT)
        response.close()


def test_a_restarted_controller_adopts_the_running_servers(orchard):
    orchard["client"].completions.create(model="llama-10m", prompt="Hello", max_tokens=2)
    node = instances(orchard)["llama-10m"]["node_id"]
    actor_id = actor("llama-10m", node)._actor_id.hex()
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "ResidencyService" in a["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)

    def adopted():
        try:
            return "llama-10m" in instances(orchard) and any(
                e["kind"] == "loaded" and "adopted" in e["reason"] for e in events(orchard, "llama-10m")
            )
        except (AssertionError, requests.RequestException):
            return False  # the new controller is not up yet

    wait_for(adopted, 90, "a new controller that adopted llama-10m")
    assert not [e for e in events(orchard, "llama-10m") if e["kind"] == "placed"]  # adopted, not loaded again
    reply = orchard["client"].completions.create(model="llama-10m", prompt="Hello", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert instances(orchard)["llama-10m"]["node_id"] == node and actor("llama-10m", node)._actor_id.hex() == actor_id
