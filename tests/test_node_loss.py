"""Rule N1 end to end: a worker node whose processes are SIGKILLed mid-stream (raylet, agent, model
server: the node is gone as a powered-off Mac is) costs the stream it ran and no more. Ray itself
declares such a node dead only after its health checks fail (tens of seconds with Ray's defaults,
which this cluster keeps); the model is served elsewhere within seconds because the node is suspect
at once."""

import time

import pytest
import requests

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from support.cluster import Http, node_args, serve_orchard, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MODEL = "llama-10m"
MIB = 1024**2
NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): the stream runs on


@pytest.fixture(scope="module")
def orchard(models_dir):
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", 0.05, 1))
    doomed = cluster.add_node(**node_args("mac-1", 0.3, 1))
    cluster.add_node(**node_args("mac-2", 0.3, 1))
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        models = [{"name": MODEL, "kind": "llm", "path": "llama-10m"}]
        policy = {"safety_margin_bytes": 16 * MIB, "safety_margin_fraction": 0, "instance_overhead_bytes": 64 * MIB, "wait_timeout_s": 30}
        base = serve_orchard({"models_dir": str(models_dir), "models": models, "policy": policy})
        yield Http(base), cluster, doomed
    finally:
        ray.shutdown()
        cluster.shutdown()


def _complete(http: Http) -> requests.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    return requests.post(http.base + "/v1/completions", json=body, headers=http.headers, timeout=15)


def test_a_killed_nodes_model_is_served_elsewhere_within_seconds(orchard):
    http, cluster, doomed = orchard
    wait_for(lambda: len([n for n in http.get("/v1/cluster").json()["nodes"] if n["alive"]]) == 3, 60, "three nodes reporting")
    loaded = http.post(f"/v1/models/{MODEL}/load", json={"node": "mac-1"})
    assert loaded.status_code == 200, loaded.text
    assert _complete(http).status_code == 200
    stream = requests.post(
        http.base + "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 500, "stream": True, "logit_bias": NEVER_END},
        headers=http.headers,
        stream=True,
        timeout=120,
    )
    lines = stream.iter_lines()
    assert next(line for line in lines if line)  # the stream runs on mac-1
    killed = time.monotonic()
    cluster.remove_node(doomed, allow_graceful=False)  # SIGKILL: raylet, agent and model server
    served_at = None
    while time.monotonic() - killed < 60:  # served by an instance on another node (the old one's worker may outlive its raylet a moment)
        try:
            if _complete(http).status_code == 200 and http.get(f"/v1/models/{MODEL}").json()["orchard"]["nodes"] == ["mac-2"]:
                served_at = time.monotonic() - killed
                break
        except requests.RequestException:
            pass
        time.sleep(0.2)
    events = http.get("/v1/cluster/events").json()["data"]
    kinds = [(e["kind"], e.get("node_id")) for e in events]
    assert served_at is not None, kinds
    assert ("node_suspect", "mac-1") in kinds, kinds
    assert ("node_dead", "mac-1") not in kinds[: kinds.index(("node_suspect", "mac-1"))]
    print(f"\nserved elsewhere {served_at:.1f} s after the kill")
    assert served_at < 8.0  # the goal is 5 s; the margin is for this shared 2-core machine
