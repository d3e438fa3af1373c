"""Unload, then load (docs/residency.md, rule X1), on a real Ray cluster: the shared one-node cluster
(a 6 GiB budget) and two registry entries of llama-10m declared at 3.5 GiB each, so the node holds
one of them at a time. Asking for B while A is resident and idle evicts A; B's model server is
created only once A's model server has stopped its engine and measured what its process still
holds (its release), and A's process then exits beside B's load. A thread watches the cluster
throughout: B's actor is listed only after A's release (the machine's one monotonic clock, which
the residency loop's events carry too)."""

import threading
import time

import psutil
import pytest
import requests

ray = pytest.importorskip("ray")
import openai  # noqa: E402
from ray import serve  # noqa: E402
from ray._private import state as ray_state  # noqa: E402
from support.cluster import key_entry, serve_orchard  # noqa: E402

from cluster.model_servers import live_model_server_names, parse_actor_name  # noqa: E402
from cluster.ray_api import NAMESPACE  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
GIB = 1024**3
KEY = "sk-orchard-eviction-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BIG = {"kind": "llm", "path": "llama-10m", "weight_bytes": "3.5GiB"}


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    models = [{"name": "evict-a"} | BIG, {"name": "evict-b"} | BIG]
    policy = {
        "min_residency_s": 0,
        "residency_per_reload": 0,
        # no spare (R1): the watch tells B's process by its name, and a spare that B's model would
        # load into exists before A exits by design (test_cluster_spares covers that path)
        "spares_per_node": 0,
        "instance_overhead_bytes": 32 * MIB,
        "safety_margin_bytes": 16 * MIB,
        "safety_margin_fraction": 0,
    }
    args = {
        "models_dir": str(models_dir),
        "models": models,
        "policy": policy,
        "api_keys": [key_entry("ops", KEY, "admin")],
    }
    base = serve_orchard(args)
    yield {"base": base, "client": openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)}
    serve.shutdown()


def get(orchard, path: str) -> dict:
    r = requests.get(orchard["base"] + path, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def ask(orchard, model: str) -> None:
    reply = orchard["client"].chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def server_of(model: str) -> str | None:
    return next((n for n in live_model_server_names() if (p := parse_actor_name(n)) is not None and p[0] == model), None)


def record_of(name: str) -> dict:
    """Ray's actor table entry (GCS) of the model server `name`, dead or alive, the latest first."""
    found = [a for a in ray_state.actors().values() if a.get("Name") == name]
    return max(found, key=lambda a: a.get("StartTime") or 0)


class Watch(threading.Thread):
    """Samples, every few ms, whether A's actor is listed or its process alive, and whether B's
    actor is listed (Ray lists a named actor from its creation on)."""

    def __init__(self, a_name: str, a_pid: int):
        super().__init__(daemon=True)
        self.a_name, self.a_pid = a_name, a_pid
        self.stop = threading.Event()
        self.stopped_at = float("inf")  # the last sample begins after this (the caller's `finish`)
        self.samples: list[tuple[float, bool, bool, bool]] = []  # (t, a listed, a's process alive, b listed)

    def finish(self) -> None:
        """Stop after one more sample taken from now on: a GCS call slow under load must not end
        the watch before it has seen the state the caller's action left."""
        self.stopped_at = time.monotonic()
        self.stop.set()

    def run(self) -> None:
        while True:
            began = time.monotonic()
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
            alive = psutil.pid_exists(self.a_pid) and psutil.Process(self.a_pid).status() != psutil.STATUS_ZOMBIE
            b_listed = any((p := parse_actor_name(n)) is not None and p[0] == "evict-b" for n in names)
            self.samples.append((time.monotonic(), self.a_name in names, alive, b_listed))
            if self.stop.is_set() and began > self.stopped_at:
                return
            time.sleep(0.005)


def test_an_evicted_victim_releases_its_memory_before_the_new_model_loads(orchard):
    ask(orchard, "evict-a")
    a_name = server_of("evict-a")
    assert a_name is not None
    a = record_of(a_name)
    assert a["State"] == "ALIVE" and a["Pid"] > 0
    watch = Watch(a_name, a["Pid"])
    watch.start()
    try:
        ask(orchard, "evict-b")  # A is idle: evicted for B
    finally:
        watch.finish()
        watch.join(10)

    # The log: evicted(A) ... released(A) ... loading(B) ... loaded(B), in that order and time; A's
    # process exits beside B's load (stopped(A) after its release).
    log = [e for e in get(orchard, "/v1/cluster/events")["data"] if e["model"] in ("evict-a", "evict-b")]
    seq = {(e["kind"], e["model"]): e for e in log}
    order = [("evicted", "evict-a"), ("released", "evict-a"), ("loading", "evict-b"), ("loaded", "evict-b")]
    assert all(k in seq for k in order) and ("stopped", "evict-a") in seq, [(e["kind"], e["model"]) for e in log]
    assert [seq[k]["seq"] for k in order] == sorted(seq[k]["seq"] for k in order)
    released, stopped, loading = seq[("released", "evict-a")], seq[("stopped", "evict-a")], seq[("loading", "evict-b")]
    assert released["at"] <= loading["at"] and released["at"] <= stopped["at"] and stopped["bytes"] >= int(3.5 * GIB)
    assert "held by its process until it exits" in released["reason"] and "evicted for evict-b" in released["reason"]
    assert "released" in stopped["reason"] and "evicted for evict-b" in stopped["reason"]
    assert "free" in loading["reason"]  # the node's report after the release showed the room

    # Ray's word: A is dead and its process gone; B's actor did not exist before A's release.
    assert record_of(a_name)["State"] == "DEAD" and not psutil.pid_exists(a["Pid"])
    b_seen = [s for s in watch.samples if s[3]]
    assert b_seen, "the watch never saw B's actor"
    assert b_seen[0][0] >= released["at"], f"B's actor was listed {released['at'] - b_seen[0][0]:.3f} s before A released its memory"

    # The node's view no longer counts A: only B is ours there.
    (node,) = get(orchard, "/v1/cluster")["nodes"]
    assert [i["model"] for i in node["instances"]] == ["evict-b"]
    assert node["memory"]["ours_bytes"] == node["instances"][0]["bytes"] + node["instances"][0]["prefix_cache_bytes"]  # X4: its kept prefixes too
