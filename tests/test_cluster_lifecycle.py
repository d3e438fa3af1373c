"""Residency over time and its faults, end to end on a real 2-node Ray cluster through HTTP, with API
keys on: idle timeout, a load that waits behind an open stream (and says so in the events), a
frozen instance cut off by the ingress's per-item timeout, a model-server actor that dies (killed,
or SIGKILLed like an out-of-memory kill), a reload right after an unload, corrupt weights that must
not evict their neighbours, what the dashboard's Actors view says, and a restarted controller
adopting the model servers that outlived it."""

import hashlib
import json
import os
import pathlib
import shutil
import signal
import threading
import time

import pytest
import requests

ray = pytest.importorskip("ray")
import openai  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from support.cluster import HEALTH, free_port, node_args, wait_for  # noqa: E402

from cluster.model_servers import create_model_server, find_model_server, live_model_server_names, parse_spare_name  # noqa: E402
from router.api.builder import build_app  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
KEY = "sk-orchard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER_KEY = "sk-orchard-team-a"  # a user key for llama-10m only, read from the environment by the app builder
LIMITED_KEY = "sk-orchard-team-b"  # rpm 6, tpm 5000, one request at a time
CHUNK_TIMEOUT_S = 6.0
NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): streams run to max_tokens


@pytest.fixture(scope="module")
def orchard(models_dir, broken_dir):
    """Head (0.7 GiB: one 400 MiB model at a time) + mac-1 (0.3 GiB: small models only). The
    dashboard runs: the Actors view (Ray's state API) is under test here."""
    dashboard_port = free_port()
    head = node_args("head", 0.7, 2) | {"include_dashboard": True, "dashboard_port": dashboard_port, "_system_config": HEALTH}
    cluster = Cluster(initialize_head=True, head_node_args=head)
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
        {"name": "doomed-llama"} | small,
        {"name": "pinned-llama", "pinned": True} | small,  # never asked for: holds no memory
        {"name": "broken-llama", "kind": "llm", "path": str(broken_dir), "weight_bytes": "40MiB", "kv_bytes_per_token": "8KiB"},
    ]
    policy = {
        "safety_margin_bytes": 16 * MIB,
        "safety_margin_fraction": 0,
        "instance_overhead_bytes": 64 * MIB,
        "min_residency_s": 0,
        "residency_per_reload": 0,
        "contention": "wait",
        "wait_timeout_s": 60,
    }
    args = {
        "models_dir": str(models_dir),
        "models": models,
        "policy": policy,
        "watch_period_s": 0.5,
        "chunk_timeout_s": CHUNK_TIMEOUT_S,
        "api_keys": [
            {"name": "ops", "role": "admin", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()},
            {"name": "team-a", "role": "user", "key_env": "ORCHARD_TEST_TEAM_A_KEY", "models": ["llama-10m"]},
            {
                "name": "team-b",
                "role": "user",
                "key_sha256": hashlib.sha256(LIMITED_KEY.encode()).hexdigest(),
                "rpm": 6,
                "tpm": 5000,
                "max_concurrent": 1,
            },
        ],
        "ingress_replicas": 2,  # the keys' limits must hold across replicas
    }
    os.environ["ORCHARD_TEST_TEAM_A_KEY"] = USER_KEY
    serve.run(build_app(args), name="orchard", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    yield {"base": base, "client": client, "broken_dir": broken_dir, "models_dir": models_dir}
    ray.shutdown()  # the whole cluster goes: Serve's graceful drain first would only add ~5 s
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


def test_a_user_key_serves_its_models_only_and_no_admin_route(orchard):
    user = openai.OpenAI(base_url=orchard["base"] + "/v1", api_key=USER_KEY, max_retries=0, timeout=120)
    assert [m.id for m in user.models.list()] == ["llama-10m"]  # the other models are not even named
    reply = user.completions.create(model="llama-10m", prompt="Once upon a time", max_tokens=3, logit_bias=NEVER_END)
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        user.completions.create(model="big-a", prompt="x", max_tokens=2)
    for path in ("/v1/cluster", "/v1/cluster/events"):
        r = requests.get(orchard["base"] + path, headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    r = requests.post(orchard["base"] + "/v1/models/llama-10m/unload", headers={"x-api-key": USER_KEY}, timeout=30)
    assert r.status_code == 403
    assert requests.get(orchard["base"] + "/ready", timeout=30).json()["status"] == "ready"


def test_a_keys_limits_hold_across_two_ingress_replicas_with_429s_and_headers(orchard):
    """Issue 13 item 2 over HTTP (recovery after the window: tests/test_limits.py)."""
    auth = {"Authorization": f"Bearer {LIMITED_KEY}"}
    body = {"model": "llama-10m", "prompt": "Go on", "max_tokens": 4000, "logit_bias": NEVER_END, "stream": True}
    r = requests.post(orchard["base"] + "/v1/completions", json=body, headers=auth, stream=True, timeout=120)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "6", r.headers
    lines = (line for line in r.iter_lines() if line)  # held: a dropped line iterator closes the connection (a disconnect)
    first = [next(lines) for _ in range(2)]  # in flight
    assert b"data: [DONE]" not in first, first
    events = [json.loads(line.removeprefix(b"data: ")) for line in first]  # the text is random: read the events, not their bytes
    assert all("error" not in e and e["choices"][0]["finish_reason"] is None for e in events), first
    blocked = []
    for _ in range(4):  # whichever replica each lands on: the count is the residency service's
        b = requests.post(orchard["base"] + "/v1/completions", json={"model": "llama-10m", "prompt": "x", "max_tokens": 2}, headers=auth, timeout=60)
        assert b.status_code == 429, (b.status_code, b.text[:300])
        blocked.append(
            (b.status_code, b.json()["error"]["type"], "max_concurrent" in b.json()["error"]["message"], bool(b.headers.get("retry-after")))
        )
    assert blocked == [(429, "rate_limit_error", True, True)] * 4, blocked
    r.close()
    time.sleep(1.5)  # the stream's lease ends
    replies = []
    for _ in range(3):
        b = requests.post(orchard["base"] + "/v1/completions", json={"model": "llama-10m", "prompt": "x", "max_tokens": 2}, headers=auth, timeout=60)
        replies.append(b)
        time.sleep(0.3)  # its lease's release (sent detached) reaches the residency service
    # 1 stream + 4 refused + 3 here = 8 requests: the refused ones were never admitted, so rpm 6 allows these
    assert [b.status_code for b in replies] == [200, 200, 200], [b.text[:200] for b in replies]
    assert int(b.headers["x-ratelimit-remaining-requests"]) == 2 and int(b.headers["x-ratelimit-remaining-tokens"]) < 5000
    # each request's header counts the tokens the ones before it used (prompt + completion, as their
    # release reported them), not what they reserved (2): the key's tpm counts what was generated
    remaining = [int(b.headers["x-ratelimit-remaining-tokens"]) for b in replies]
    used = [b.json()["usage"]["total_tokens"] for b in replies]
    assert used[0] > 2 and [remaining[0] - remaining[1], remaining[1] - remaining[2]] == used[:2], (remaining, used)
    b = requests.post(orchard["base"] + "/v1/completions", json={"model": "llama-10m", "prompt": "x", "max_tokens": 4500}, headers=auth, timeout=60)
    assert b.status_code == 429 and "tpm is 5000" in b.json()["error"]["message"]  # 4500 reserved would pass the minute's budget
    m = requests.post(orchard["base"] + "/v1/messages", json={"model": "llama-10m", "max_tokens": 4500, "messages": [{"role": "user", "content": "x"}]},
                      headers={"x-api-key": LIMITED_KEY}, timeout=60)  # fmt: skip
    assert m.status_code == 429 and m.json()["error"]["type"] == "rate_limit_error"  # Anthropic's format


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus package (the Makefile installs it)")
def test_prometheus_scrapes_orchards_series_and_the_ingress_serves_metrics(orchard, tmp_path):
    """Issue 13 item 4: Prometheus over Ray's service-discovery file finds Orchard's series after a
    request; GET /metrics answers in Prometheus's text format (admin key)."""
    from cluster import prometheus

    orchard["client"].completions.create(model="llama-10m", prompt="Hello", max_tokens=3, logit_bias=NEVER_END)
    sd_file = pathlib.Path(ray._private.worker._global_node.get_temp_dir_path()) / "prom_metrics_service_discovery.json"
    port = free_port()
    prometheus.start(sd_file, tmp_path / "prometheus", port=port, interval_s=2)
    try:
        url = f"http://127.0.0.1:{port}"
        found = wait_for(lambda: prometheus.query(url, "ray_orchard_generated_tokens_total"), 90, "Orchard's tokens counter in Prometheus")
        assert any(r["metric"].get("model") == "llama-10m" and float(r["value"][1]) >= 3 for r in found), found
        assert wait_for(lambda: prometheus.query(url, "ray_orchard_loads_total"), 30, "the loads counter")
    finally:
        assert prometheus.stop(tmp_path / "prometheus")
    r = requests.get(orchard["base"] + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'orchard_node_usable_bytes{node="head"}' in r.text and 'orchard_events_total{kind="loaded",model="llama-10m"' in r.text
    assert 'orchard_spec_plain_steps_total{model="llama-10m"' in r.text  # the instance's speculation counters (its engine's)
    assert requests.get(orchard["base"] + "/metrics", headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30).status_code == 403


def test_no_key_appears_in_the_ray_session_logs(orchard):
    session = pathlib.Path(ray._private.worker._global_node.get_session_dir_path())
    seen = [
        str(f)
        for f in session.rglob("*")
        if f.is_file() and f.stat().st_size < 50 * 2**20 and (KEY.encode() in f.read_bytes() or USER_KEY.encode() in f.read_bytes())
    ]
    assert not seen, seen


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
    since = get(orchard, "/v1/cluster/events")["data"][-1]["seq"]
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
    waiting = [e for e in get(orchard, f"/v1/cluster/events?since={since}")["data"] if e["kind"] == "waiting"]  # issue 10 item 7
    assert len(waiting) == 1 and waiting[0]["model"] == "big-b" and waiting[0]["node_id"] == "head", waiting
    assert "big-a" in waiting[0]["reason"] and "busy" in waiting[0]["reason"], waiting[0]["reason"]
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


def test_a_frozen_instance_fails_a_non_streamed_request_after_the_inactivity_timeout(orchard):
    """A non-streamed request is one call answered at its end (WholeGeneration): while it runs, the
    ingress asks its instance for progress; a frozen instance answers nothing, and the request ends
    with a 503 model_unavailable within the timeout (and the progress check's), not at the end of
    its 4000 tokens or never."""
    _ready(orchard, "frozen-llama")
    server = actor("frozen-llama", instances(orchard)["frozen-llama"]["node_id"])
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    result: dict = {}

    def ask() -> None:
        body = {"model": "frozen-llama", "prompt": "Go on", "max_tokens": 4000, "logit_bias": NEVER_END}
        r = requests.post(orchard["base"] + "/v1/completions", json=body, headers=AUTH, timeout=120)
        result.update(status=r.status_code, body=r.json(), at=time.monotonic())

    waiter = threading.Thread(target=ask)
    waiter.start()
    wait_for(lambda: ray.get(server.health.remote()).running_requests == 1, 30, "the request running")
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        waiter.join(CHUNK_TIMEOUT_S + 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert result["status"] == 503, result
    error = result["body"]["error"]
    assert error["code"] == "model_unavailable" and "made no progress" in error["message"], error
    assert result["at"] - frozen_at < CHUNK_TIMEOUT_S + 10, result["at"] - frozen_at
    # thawed, it was told to stop (the call was cancelled): nothing runs on for nobody
    wait_for(lambda: ray.get(server.health.remote()).running_requests == 0, 30, "the generation cancelled")


def test_a_model_server_that_dies_mid_generation_costs_a_non_streamed_request_nothing(orchard):
    """Nothing of a non-streamed answer reaches its client before the end, so an instance that dies
    halfway through costs the request nothing: it moves, once, to a fresh lease (the model placed
    again) and the client gets its whole answer."""
    before = _ready(orchard, "doomed-llama")
    server = ray.get_actor(before["actor"], namespace="orchard")
    result: dict = {}

    def ask() -> None:
        body = {"model": "doomed-llama", "prompt": "Go on", "max_tokens": 400, "logit_bias": NEVER_END}
        r = requests.post(orchard["base"] + "/v1/completions", json=body, headers=AUTH, timeout=120)
        result.update(status=r.status_code, body=r.json())

    waiter = threading.Thread(target=ask)
    waiter.start()
    wait_for(lambda: ray.get(server.counters.remote()).get("generation_tokens", 0) > 20, 30, "some tokens generated")
    ray.kill(server, no_restart=True)
    waiter.join(120)
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 400, result
    assert instances(orchard)["doomed-llama"]["actor"] != before["actor"]  # a new incarnation answered
    died = wait_for(lambda: [e for e in events(orchard, "doomed-llama") if e["kind"] == "died"], 15, "a died event")
    assert "died" in died[-1]["reason"]


def _ready(orchard, model: str) -> dict:
    orchard["client"].completions.create(model=model, prompt="Hello", max_tokens=2)
    return instances(orchard)[model]


def _unload_all_but(orchard, keep: str) -> None:
    for model in instances(orchard):
        if model != keep:
            r = requests.post(orchard["base"] + f"/v1/models/{model}/unload", headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
    wait_for(lambda: set(instances(orchard)) == {keep}, 20, f"{keep} alone")


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_dead_model_server_is_noticed_and_the_model_placed_again(orchard, how):
    """Issue 10 item 1: the controller learns of the death, drops the instance with an event naming
    the cause, and the next request places the model again; a stream in flight ends with an error."""
    before = _ready(orchard, "doomed-llama")
    server = ray.get_actor(before["actor"], namespace="orchard")
    response, lines = _stream_lines(orchard, {"model": "doomed-llama", "prompt": "Go on", "max_tokens": 4000, "logit_bias": NEVER_END})
    next(lines)
    killed_at = time.monotonic()
    if how == "ray.kill":
        ray.kill(server, no_restart=True)
    else:  # what an out-of-memory kill looks like
        os.kill(ray.get(server.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    last = None
    for line in lines:
        if line == b"data: [DONE]":
            break
        last = json.loads(line.removeprefix(b"data: "))
        if "error" in last:
            break
    response.close()
    assert last is not None and "error" in last and last["error"]["code"] == "model_unavailable", last
    died = wait_for(lambda: [e for e in events(orchard, "doomed-llama") if e["kind"] == "died" and e["at"] > 0], 15, "a died event")
    noticed_s = time.monotonic() - killed_at
    assert "doomed-llama" not in instances(orchard) or instances(orchard)["doomed-llama"]["actor"] != before["actor"]
    assert "died" in died[-1]["reason"] and noticed_s < 10, (died[-1], noticed_s)
    reply = orchard["client"].completions.create(model="doomed-llama", prompt="Hello", max_tokens=3, logit_bias=NEVER_END)
    assert reply.usage.completion_tokens == 3
    assert instances(orchard)["doomed-llama"]["actor"] != before["actor"]  # a new incarnation


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_sent_right_after_its_model_server_died_is_answered_by_a_new_one(orchard, stream):
    """The ingress still holds its lease on the dead instance (the controller has not noticed yet):
    the request finds the actor gone before any output and moves, once, to a fresh lease, for which
    the model is placed again. The client sees an answer, not a 503."""
    before = _ready(orchard, "doomed-llama")
    ray.kill(ray.get_actor(before["actor"], namespace="orchard"), no_restart=True)
    body = {"model": "doomed-llama", "prompt": "Hello", "max_tokens": 3, "logit_bias": NEVER_END}
    if stream:
        chunks = list(orchard["client"].completions.create(**body, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    else:
        assert orchard["client"].completions.create(**body).usage.completion_tokens == 3
    assert instances(orchard)["doomed-llama"]["actor"] != before["actor"]  # a new incarnation answered


def test_a_reload_right_after_an_unload_never_reaches_the_dying_actor(orchard):
    """Issue 10 item 2: unload, then at once request the model again, three times over."""
    for _ in range(3):
        _ready(orchard, "doomed-llama")
        r = requests.post(orchard["base"] + "/v1/models/doomed-llama/unload", headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        reply = orchard["client"].completions.create(model="doomed-llama", prompt="Hello", max_tokens=3, logit_bias=NEVER_END)
        assert reply.usage.completion_tokens == 3


def test_corrupt_weights_fail_once_evict_nothing_and_are_tried_again_when_fixed(orchard):
    """Issue 10 item 3: a truncated safetensors file. The model fits without eviction; its failure
    is not retried, evicts nothing, and later requests get the same 503 at once with Retry-After."""
    healthy = _ready(orchard, "llama-10m")
    _unload_all_but(orchard, "llama-10m")  # the earlier tests' models go: where they landed decides whether it fits
    since = get(orchard, "/v1/cluster/events")["data"][-1]["seq"]
    statuses, retry_after, messages = [], [], []
    for _ in range(3):  # what one openai SDK call with its two retries sends
        r = requests.post(
            orchard["base"] + "/v1/completions", json={"model": "broken-llama", "prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=120
        )
        statuses.append(r.status_code)
        retry_after.append(r.headers.get("retry-after"))
        messages.append(r.json()["error"]["message"])
    assert statuses == [503, 503, 503] and all(retry_after), (statuses, retry_after)
    later = get(orchard, f"/v1/cluster/events?since={since}")["data"]
    assert [e["kind"] for e in later if e["model"] == "broken-llama"].count("load_failed") == 1, later
    assert not [e for e in later if e["kind"] == "evicted"], later
    assert "bad_files" in messages[-1] and "tried again in" in messages[-1]
    assert instances(orchard)["llama-10m"]["actor"] == healthy["actor"]  # the neighbour never moved
    models = {m["id"]: m["orchard"] for m in get(orchard, "/v1/models")["data"]}
    assert models["broken-llama"]["status"] == "failed" and "bad_files" in models["broken-llama"]["failure"]["reason"]
    shutil.copy(orchard["models_dir"] / "llama-10m" / "model.safetensors", orchard["broken_dir"] / "model.safetensors")  # fixed
    reply = orchard["client"].completions.create(model="broken-llama", prompt="Hello", max_tokens=2, logit_bias=NEVER_END)
    assert reply.usage.completion_tokens == 2


def test_the_dashboard_shows_each_instances_state_size_and_why_it_ended(orchard):
    """Issue 10 item 10, through Ray's state API (what the dashboard's Actors view reads): a loaded
    instance's repr says ready and its size; an unloaded one ended by exit_actor, not ray.kill;
    one that failed to load says why."""
    from ray.util.state import list_actors, list_tasks

    live = _ready(orchard, "llama-10m")
    # doomed-llama loads where a spare waits (rule R1), so its row is a spare's and its task names it;
    # the earlier tests' models go first, so that a node has room for a spare
    _unload_all_but(orchard, "llama-10m")
    spared = wait_for(lambda: [n["node_id"] for n in get(orchard, "/v1/cluster")["nodes"] if n["spare"]], 60, "a spare")
    r = requests.post(orchard["base"] + "/v1/models/doomed-llama/load", json={"node": spared[0]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    gone = instances(orchard)["doomed-llama"]["actor"]
    assert parse_spare_name(gone) == spared[0]
    requests.post(orchard["base"] + "/v1/models/doomed-llama/unload", headers=AUTH, timeout=60)
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == gone], 20, "the unloaded actor to end")

    def actor_row(name):
        rows = list_actors(filters=[("name", "=", name)], detail=True, raise_on_missing_output=False)
        return rows[-1] if rows else None

    row = wait_for(lambda: actor_row(live["actor"]), 20, "the live actor in the state API")
    assert row["state"] == "ALIVE", row
    if parse_spare_name(live["actor"]) is None:  # started for its model: loaded in creation, so its row tells
        assert "ready" in row["repr_name"] and "MiB" in row["repr_name"], row["repr_name"]
    else:  # a spare took it (R1): as doomed-llama below
        assert "started as a spare" in row["repr_name"], row["repr_name"]
    dead = wait_for(lambda: (r := actor_row(gone)) and r["state"] == "DEAD" and r, 20, "the unloaded actor DEAD")
    cause = json.dumps(dead.get("death_cause"))
    # Ray words an exit_actor() two ways: "exit_actor() is called." or, when the actor's other
    # running calls (a watch round's health probe) finish first, "INTENDED_USER_EXIT ... User
    # requested to exit the actor." (seen once in a full run); a ray.kill says "ray.kill".
    assert ("exit_actor" in cause or "INTENDED_USER_EXIT" in cause) and "ray.kill" not in cause, cause
    assert "started as a spare" in dead["repr_name"], dead["repr_name"]
    took = [("actor_id", "=", dead["actor_id"]), ("name", "=", "take doomed-llama")]
    # a worker sends its task events to the GCS about once a second: the state API learns of the end late
    wait_for(lambda: [t for t in list_tasks(filters=took, raise_on_missing_output=False) if t["state"] == "FINISHED"], 20, "the take task's end")


def test_a_restarted_controller_adopts_the_running_servers_and_keeps_the_operators_state(orchard):
    """Adoption of running servers, and issue 13 item 3: pins, unpins and the event log survive."""
    orchard["client"].completions.create(model="llama-10m", prompt="Hello", max_tokens=2)
    node = instances(orchard)["llama-10m"]["node_id"]
    actor_id = actor("llama-10m", node)._actor_id.hex()
    # a second incarnation nobody accounts for (what a controller killed mid-load leaves): stopped, not adopted
    ray_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("Labels", {}).get("orchard.node") == node)
    stale = create_model_server(("llm", "llama-10m", str(orchard["models_dir"] / "llama-10m")), node, ray_node_id=ray_node, incarnation="stale001")
    ray.get(stale.load.remote(), timeout=60)
    for path in ("/v1/models/llama-10m/pin", "/v1/models/pinned-llama/unpin"):
        assert requests.post(orchard["base"] + path, headers=AUTH, timeout=30).status_code == 200
    before = get(orchard, "/v1/cluster/events")["data"]
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "ResidencyService" in a["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    last_seq = before[-1]["seq"]

    def adopted():
        try:
            later = [e for e in get(orchard, f"/v1/cluster/events?since={last_seq}")["data"] if e["model"] == "llama-10m"]
            return "llama-10m" in instances(orchard) and any(e["kind"] == "loaded" and "adopted" in e["reason"] for e in later)
        except (AssertionError, requests.RequestException):
            return False  # the new controller is not up yet

    wait_for(adopted, 90, "a new controller that adopted llama-10m")
    after = get(orchard, "/v1/cluster/events")["data"]
    assert [e["seq"] for e in after[: len(before)]] == [e["seq"] for e in before]  # the log before the kill, still listed
    assert min(e["seq"] for e in after[len(before) :]) > last_seq  # and numbered on after it
    assert not [e for e in after[len(before) :] if e["model"] == "llama-10m" and e["kind"] == "placed"]  # adopted, not loaded again
    models = {m["id"]: m["orchard"] for m in get(orchard, "/v1/models")["data"]}
    assert models["llama-10m"]["pinned"] is True and models["pinned-llama"]["pinned"] is False  # the pin and the unpin in force
    reply = orchard["client"].completions.create(model="llama-10m", prompt="Hello", max_tokens=3, logit_bias=NEVER_END)
    assert reply.usage.completion_tokens == 3
    assert instances(orchard)["llama-10m"]["node_id"] == node and instances(orchard)["llama-10m"]["actor"] != f"orchard:llama-10m@{node}#stale001"
    wait_for(lambda: f"orchard:llama-10m@{node}#stale001" not in live_model_server_names(), 30, "the stale incarnation to be stopped")
    assert actor("llama-10m", node)._actor_id.hex() == actor_id
