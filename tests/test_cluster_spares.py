"""Rule R1 on a running cluster (the shared one-node cluster, real models, HTTP): the node keeps a
spare model-server process; a load runs in it (the instance's actor is the spare's, and its log
says which model it took), a new spare starts after, a spare that dies is replaced, an evicted
model's process is the node's next spare, and the spare's memory is in the node's accounting and on
the console's memory bar."""

import time

import pytest
import requests

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from support.cluster import Http, serve_orchard, wait_for  # noqa: E402

from cluster.model_servers import find_model_server, parse_spare_name  # noqa: E402
from cluster.ray_api import NAMESPACE  # noqa: E402
from router.residency.registry import from_manifest  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
NODE = "head"


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    # spares on (the default); an overhead that covers a process; one LLM at a time: a second evicts the first
    policy = {"instance_overhead_bytes": 384 * MIB, "max_per_kind_per_node": {"llm": 1}}
    base = serve_orchard({"models_dir": str(models_dir), "models": from_manifest(models_dir), "policy": policy, "watch_period_s": 0.5})
    yield Http(base)
    serve.shutdown()


def node_view(http: Http) -> dict:
    return next(n for n in http.get("/v1/cluster").json()["nodes"] if n["node_id"] == NODE)


def spare_of(http: Http) -> dict | None:
    return node_view(http)["spare"]


def test_a_load_runs_in_the_nodes_spare_and_another_spare_follows(orchard):
    first = wait_for(lambda: spare_of(orchard), 60, "a spare on the node")
    assert parse_spare_name(first["actor"]) == NODE and first["bytes"] > 20 * MIB  # its process, measured
    view = node_view(orchard)
    assert view["memory"]["ours_bytes"] >= first["bytes"]  # ours: in the accounting, not foreign

    r = requests.post(
        orchard.base + "/v1/completions",
        json={"model": "llama-10m", "prompt": "Once upon a time", "max_tokens": 4},
        headers=orchard.headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    instance = next(i for i in node_view(orchard)["instances"] if i["model"] == "llama-10m")
    assert instance["actor"] == first["actor"]  # the spare's process serves it
    assert find_model_server("llama-10m", NODE)._actor_id == ray.get_actor(first["actor"], namespace=NAMESPACE)._actor_id
    health = ray.get(ray.get_actor(first["actor"], namespace=NAMESPACE).health.remote(), timeout=30)
    assert health.model == "llama-10m" and health.status == "ready"

    second = wait_for(lambda: (s := spare_of(orchard)) is not None and s["actor"] != first["actor"] and s, 60, "the next spare")
    assert parse_spare_name(second["actor"]) == NODE

    loaded = [e for e in orchard.get("/v1/cluster/events").json()["data"] if e["kind"] == "loaded" and e["model"] == "llama-10m"]
    assert loaded and loaded[-1]["seconds"] is not None  # the whole start is what a reload costs (E3)


def test_a_spare_that_dies_is_replaced_and_unloading_a_model_born_in_a_spare_ends_its_process(orchard):
    spare = wait_for(lambda: spare_of(orchard), 60, "a spare on the node")
    ray.kill(ray.get_actor(spare["actor"], namespace=NAMESPACE), no_restart=True)
    wait_for(lambda: (s := spare_of(orchard)) is not None and s["actor"] != spare["actor"], 60, "a new spare after the old one died")

    if not any(i["model"] == "llama-10m" for i in node_view(orchard)["instances"]):
        orchard.post("/v1/models/llama-10m/load", json={})
    actor = next(i["actor"] for i in node_view(orchard)["instances"] if i["model"] == "llama-10m")
    r = orchard.post("/v1/models/llama-10m/unload", json={})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor, namespace=NAMESPACE)
        except ValueError:
            break  # its name is free: the process ended
        time.sleep(0.3)
    else:
        raise AssertionError(f"{actor} still runs after its model was unloaded")


def test_the_console_shows_the_spare_on_the_nodes_memory_bar(orchard):
    spare = wait_for(lambda: spare_of(orchard), 60, "a spare on the node")
    page = orchard.get("/v1/cluster/console")
    assert page.status_code == 200, page.text
    node = next(n for n in page.json()["nodes"] if n["node_id"] == NODE)
    segments = [s for s in node["segments"] if s["kind"] == "spare"]
    assert segments and segments[0]["bytes"] == spare["bytes"]


def _complete(http: Http, model: str) -> None:
    r = requests.post(
        http.base + "/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 4}, headers=http.headers, timeout=120
    )
    assert r.status_code == 200, r.text


def test_an_evicted_models_process_is_the_nodes_next_spare_and_takes_the_next_model(orchard):
    """One LLM at a time here: smollm2 evicts llama-10m, whose process (born a spare) gives its
    model's memory back and becomes the node's spare instead of exiting; llama-10m, asked again,
    loads into that same process, its second model, and answers."""
    _complete(orchard, "llama-10m")
    first = next(i["actor"] for i in node_view(orchard)["instances"] if i["model"] == "llama-10m")
    wait_for(lambda: (s := spare_of(orchard)) is not None and s["actor"] != first, 60, "a spare beside llama-10m")
    _complete(orchard, "smollm2-135m-instruct")
    spare = wait_for(lambda: (s := spare_of(orchard)) is not None and s["actor"] == first and s, 60, "llama-10m's process as the spare")
    assert spare["bytes"] > 20 * MIB and [i["model"] for i in node_view(orchard)["instances"]] == ["smollm2-135m-instruct"]
    health = ray.get(ray.get_actor(first, namespace=NAMESPACE).health.remote(), timeout=30)
    assert health.status == "spare" and health.model == ""
    events = orchard.get("/v1/cluster/events").json()["data"]
    stopped = [e for e in events if e["kind"] == "stopped" and e["model"] == "llama-10m"]
    assert stopped and "spare" in stopped[-1]["reason"]

    _complete(orchard, "llama-10m")  # smollm2 goes; llama-10m loads into the process it left
    again = next(i for i in node_view(orchard)["instances"] if i["model"] == "llama-10m")
    assert again["actor"] == first
    health = ray.get(ray.get_actor(first, namespace=NAMESPACE).health.remote(), timeout=30)
    assert health.model == "llama-10m" and health.status == "ready"
