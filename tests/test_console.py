"""The console (issue 29) without a cluster: its sentences (router/console/wording.py), its view of a
cluster (router/console/view.py: memory bars, protections, caps, copies), and its routes' door on the
real app (the page's files need no key and carry a strict CSP; the admin routes are a 401 without a
key and a 403 for a user key, in OpenAI's error format). The routes against a real cluster and the
page in a real browser: tests/test_console_cluster.py."""

import asyncio
import json
from typing import Any

import pytest

from deployments.wire.events import ClusterEvent
from policy import InstanceRef, InstanceState, Place, PolicyConfig, Reject, Use, Wait
from policy.decisions import Blocker
from router.api import guard
from router.api.app import app
from router.api.ingress import Ingress
from router.api.keys import KeyEntry, digest, resolve
from router.console.view import ConsoleSettings, ModelFacts, compose
from router.console.wording import decision_sentence, event_sentence

MIB, GIB = 1024**2, 1024**3
ADMIN, USER = "sk-admin-console", "sk-user-console"


# ---- sentences ---------------------------------------------------------------------------------


def test_an_eviction_reads_as_who_left_where_and_for_whom():
    e = ClusterEvent(
        seq=7,
        at=1.0,
        kind="evicted",
        model="llama-10m",
        node_id="mac-1",
        bytes=130 * MIB,
        reason="to place smollm2: evicting llama-10m@mac-1",
        cause="placement",
    )
    assert event_sentence(e) == "llama-10m was evicted from mac-1 (130 MiB) to place smollm2: evicting llama-10m@mac-1"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(kind="loaded", model="m", node_id="n", bytes=GIB, seconds=2.5), "m is loaded on n (1.0 GiB) in 2.5 s"),
        (
            dict(kind="unloaded", model="m", node_id="n", bytes=GIB, reason="idle", cause="idle"),
            "m was unloaded on n (1.0 GiB): it was idle past its idle timeout",
        ),
        (dict(kind="waiting", model="m", node_id="n", reason="busy b"), "a request for m is waiting behind n: busy b"),
        (dict(kind="died", model="m", node_id="n", reason="its actor died: OOM"), "m on n died: its actor died: OOM"),
        (dict(kind="node_up", node_id="n", reason="1.0 GiB usable"), "node n joined: 1.0 GiB usable"),
        (dict(kind="pinned", model="m"), "m was pinned: it is never evicted"),
        (
            dict(kind="fetched", model="m", node_id="n", reason="from head over a direct stream"),
            "m's weights arrived on n: from head over a direct stream",
        ),
    ],
)
def test_every_kind_of_event_reads_as_a_sentence(fields, expected):
    assert event_sentence(ClusterEvent(seq=1, at=0.0, **fields)) == expected


def test_a_decision_reads_as_what_would_happen():
    ref = InstanceRef(node_id="head", model="llama-10m")
    place = Place(model="smollm2", node_id="head", device="cpu", bytes=622 * MIB, evict=(ref,), reason="evicting llama-10m@head")
    assert decision_sentence(place) == "load smollm2 on head (cpu, 622 MiB) after evicting llama-10m from head"
    assert decision_sentence(Place(model="a", node_id="n", device="metal", bytes=2 * GIB)) == "load a on n (metal, 2.0 GiB), with no eviction"
    assert decision_sentence(Use(instance=ref)).startswith("llama-10m is already loaded on head")
    wait = Wait(model="b", code="busy", message="m", blockers=(Blocker(instance=ref, protection="busy", bytes=GIB),), retry_after_s=1)
    assert decision_sentence(wait) == "wait for b: busy instances stand in the way (busy: llama-10m@head (1.0 GiB)); asks again in 1.0 s"
    reject = Reject(model="c", code="blocked", message="m", blockers=(Blocker(instance=ref, protection="pinned", bytes=GIB),))
    assert decision_sentence(reject) == "refuse c (blocked) (pinned: llama-10m@head (1.0 GiB))"


# ---- the view ----------------------------------------------------------------------------------


def instance(
    model: str, nbytes: int, *, status: str = "ready", in_flight: int = 0, last_used: float = 0.0, loaded_at: float = 0.0, leases: int = 0
) -> dict:
    """An instance as ResidencyService.cluster() lists it: the policy's InstanceState plus its leases and actor."""
    state = InstanceState(model=model, device="cpu", bytes=nbytes, status=status, in_flight=in_flight, last_used=last_used, loaded_at=loaded_at)  # type: ignore[arg-type]
    return state.model_dump() | {"leases": leases, "actor": f"orchard:{model}@x#1"}


def node(node_id: str, usable: int, foreign: int, instances: list[dict], *, alive: bool = True, store: dict | None = None) -> dict:
    ours = sum(i["bytes"] for i in instances)
    memory = {
        "total_bytes": 16 * GIB,
        "usable_bytes": usable,
        "foreign_bytes": foreign,
        "headroom_bytes": usable - foreign - ours,
        "ours_bytes": ours,
    }
    return {
        "node_id": node_id,
        "alive": alive,
        "draining": False,
        "devices": ["cpu"],
        "labels": {},
        "memory": memory,
        "instances": instances,
        "store": store,
    }


FACTS = {
    "big": ModelFacts(kind="llm", weight_bytes=500 * MIB, kv_reserved_bytes=100 * MIB, overhead_bytes=64 * MIB),
    "emb": ModelFacts(kind="embedding", role="utility", weight_bytes=90 * MIB, overhead_bytes=64 * MIB, keep_warm=True),
    "small": ModelFacts(kind="llm", weight_bytes=40 * MIB, kv_reserved_bytes=30 * MIB, overhead_bytes=64 * MIB, idle_ttl_s=600),
}
POLICY = PolicyConfig(safety_margin_bytes=64 * MIB, safety_margin_fraction=0, min_residency_s=10, max_instances_per_node=2, max_per_kind={"llm": 2})


def scene() -> tuple[dict, list[dict]]:
    store = {"used_bytes": 600 * MIB, "budget_bytes": None, "free_bytes": 10 * GIB, "complete": {}, "partial": {}, "fetching": {}}
    cluster = {
        "nodes": [
            node(
                "head",
                1 * GIB,
                100 * MIB,
                [instance("big", 664 * MIB, in_flight=2, last_used=95.0, loaded_at=20.0), instance("emb", 154 * MIB, last_used=40.0)],
            ),
            node("mac-1", 512 * MIB, 0, [instance("small", 134 * MIB, last_used=90.0, loaded_at=95.0)], store=store),
            node("mac-2", 512 * MIB, 0, [], alive=False),
        ],
        "policy": POLICY.model_dump(mode="json"),
        "ingress": [{"node_id": "mac-1", "url": "http://127.0.0.1:30001"}],
    }
    models = [
        {
            "id": "big",
            "kind": "llm",
            "status": "loaded",
            "pinned": True,
            "keep_warm": False,
            "nodes": ["head"],
            "stored_on": ["head"],
            "fetching": {},
        },
        {
            "id": "emb",
            "kind": "embedding",
            "status": "loaded",
            "pinned": False,
            "keep_warm": True,
            "nodes": ["head"],
            "stored_on": ["head"],
            "fetching": {},
        },
        {
            "id": "small",
            "kind": "llm",
            "status": "loaded",
            "pinned": False,
            "keep_warm": False,
            "nodes": ["mac-1"],
            "stored_on": ["head"],
            "fetching": {"mac-1": {"done_bytes": 10 * MIB, "total_bytes": 40 * MIB, "source": "head", "bytes_per_s": 5e6, "eta_s": 6.0}},
        },
    ]
    return cluster, models


def test_a_nodes_bar_splits_its_usable_memory_into_weights_kv_other_processes_margin_and_room():
    cluster, models = scene()
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0)
    head = view.nodes[0]
    assert [(s.kind, s.model, s.bytes) for s in head.segments] == [
        ("weights", "big", 564 * MIB),
        ("kv", "big", 100 * MIB),
        ("weights", "emb", 154 * MIB),
        ("foreign", None, 100 * MIB),
        ("free", None, 42 * MIB),
        ("margin", None, 64 * MIB),
    ]
    assert sum(s.bytes for s in head.segments) == head.usable_bytes
    assert "42 MiB of room for another model (after the 64 MiB margin) out of 1.0 GiB usable" in head.words
    assert view.nodes[1].words.startswith("mac-1: 134 MiB held by 1 instance(s)") and view.nodes[1].store.words.startswith("store: 600 MiB used")
    assert view.nodes[1].ingress_url == "http://127.0.0.1:30001" and not view.nodes[2].alive and "dead" in view.nodes[2].words


def test_an_instances_kept_prompt_prefixes_are_its_own_segment_not_other_processes():
    """X4: big's 50 MiB of kept prefixes are its memory (GET /v1/cluster lists them per instance and
    in ours_bytes, out of foreign): a `cache` segment of big's beside its KV, and the node's words
    say how much of what the instances hold they would give back."""
    cluster, models = scene()
    head = cluster["nodes"][0]
    head["instances"][0]["prefix_cache_bytes"] = 50 * MIB
    head["memory"]["ours_bytes"] += 50 * MIB
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0).nodes[0]
    assert [(s.kind, s.model, s.bytes) for s in view.segments][:4] == [
        ("weights", "big", 564 * MIB),
        ("kv", "big", 100 * MIB),
        ("cache", "big", 50 * MIB),
        ("weights", "emb", 154 * MIB),
    ]
    assert [(s.kind, s.bytes) for s in view.segments][4:] == [("foreign", 100 * MIB), ("margin", 56 * MIB)]
    assert sum(s.bytes for s in view.segments) == view.usable_bytes
    assert "868 MiB held by 2 instance(s) (50 MiB of it kept prompt prefixes, given back before any eviction)" in view.words
    (big,) = [i for i in compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0).instances if i.model == "big"]
    assert (big.bytes, big.kv_bytes, big.cache_bytes) == (664 * MIB, 100 * MIB, 50 * MIB)


def test_a_spare_process_is_its_own_segment_and_the_node_says_the_next_load_runs_in_it():
    """R1: a node's spare (GET /v1/cluster's `spare`, in ours_bytes) is a `spare` segment, not room
    and not other processes; the bar still adds up to the usable memory."""
    cluster, models = scene()
    mac = cluster["nodes"][1]
    mac["spare"] = {"actor": "orchard:@mac-1#1", "bytes": 180 * MIB}
    mac["memory"]["ours_bytes"] += 180 * MIB
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0).nodes[1]
    assert ("spare", 180 * MIB) in [(s.kind, s.bytes) for s in view.segments]
    assert sum(s.bytes for s in view.segments) == view.usable_bytes
    assert "a spare process (180 MiB: the next load here runs in it)" in view.words


def test_an_overcommitted_node_shows_by_how_much():
    cluster, models = scene()
    cluster["nodes"][1]["memory"]["foreign_bytes"] = 450 * MIB
    segments = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0).nodes[1].segments
    assert segments[-1].kind == "over" and segments[-1].bytes == 72 * MIB


def test_each_instance_says_what_protects_it_and_why_it_stays():
    cluster, models = scene()
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0)
    by = {i.model: i for i in view.instances}
    assert [g.protection for g in by["big"].guards] == ["pinned", "busy"]
    assert by["big"].stays.startswith("protected now: pinned") and by["big"].kv_bytes == 100 * MIB
    assert [g.protection for g in by["emb"].guards] == ["keep_warm"] and by["emb"].stays.startswith("evictable") and "kept warm" in by["emb"].stays
    assert [g.protection for g in by["small"].guards] == ["min_residency"]  # loaded 5 s ago, 10 s minimum
    assert "evictable in 5.0 s" in by["small"].guards[0].words and by["small"].idle_s == 10.0
    # without the controller's clock nothing time-based is claimed
    blind = {i.model: i for i in compose(cluster, models, ConsoleSettings(models=FACTS), now=None).instances}
    assert [g.protection for g in blind["small"].guards] == [] and blind["small"].idle_s is None and "after 10 min idle" in blind["small"].stays


def test_the_policy_counts_each_cap_against_what_is_used_and_names_the_models_roles():
    cluster, models = scene()
    policy = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0).policy
    caps = {(c.name, c.scope): (c.used, c.limit) for c in policy.caps}
    assert caps == {("max_instances_per_node", "head"): (2, 2), ("max_instances_per_node", "mac-1"): (1, 2), ("max_per_kind", "llm"): (2, 2)}
    assert (policy.utility, policy.pinned, policy.keep_warm, policy.eviction) == (["emb"], ["big"], ["emb"], "cost")
    assert any(s.startswith("Eviction preference: cost: evict what is cheapest to lose") for s in policy.sentences)


def test_a_copy_in_progress_shows_its_progress_rate_and_eta_on_its_nodes_store():
    cluster, models = scene()
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0)
    (copy,) = view.nodes[1].store.copies
    assert (copy.model, copy.done_bytes, copy.total_bytes) == ("small", 10 * MIB, 40 * MIB)
    assert copy.words == "small to mac-1: 10 MiB of 40 MiB at 5.0 MB/s, about 6.0 s left"


def test_instances_link_to_their_actor_in_the_ray_dashboard_when_its_address_is_known():
    cluster, models = scene()
    ids = {"orchard:big@x#1": "abc123"}
    view = compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0, dashboard_url="http://127.0.0.1:8265", actor_ids=ids)
    by = {i.model: i for i in view.instances}
    assert by["big"].actor_url == "http://127.0.0.1:8265/#/actors/abc123" and by["emb"].actor_url is None
    assert compose(cluster, models, ConsoleSettings(models=FACTS), now=100.0, actor_ids=ids).instances[0].actor_url is None


# ---- the door ----------------------------------------------------------------------------------


@pytest.fixture
def keyed_app():
    """The real app, configured with an admin and a user key (no residency: nothing here reaches it)."""
    principals = resolve([KeyEntry(name="ops", role="admin", key_sha256=digest(ADMIN)), KeyEntry(name="team", role="user", key_sha256=digest(USER))])
    Ingress(None, principals=principals)
    guard.configure(guard.GuardSettings())
    yield
    guard.configure(None)
    Ingress(None)


def call(path: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    messages: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in ({"host": "127.0.0.1:8000"} | (headers or {})).items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": {k.decode(): v.decode() for k, v in start["headers"]}, "body": body}


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/console.js", "/ui/console.css"])
def test_the_page_and_its_files_need_no_key_and_allow_nothing_from_elsewhere(keyed_app, path):
    r = call(path)
    assert r["status"] == 200 and r["body"]
    csp = r["headers"]["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert b"http://" not in r["body"] and b"https://" not in r["body"]  # no CDN, nothing fetched from elsewhere


def test_the_page_keeps_the_key_in_session_storage_and_sends_it_only_in_a_header(keyed_app):
    script = call("/ui/console.js")["body"].decode()
    assert "sessionStorage" in script and "localStorage" not in script
    assert "Authorization" in script and "key=" not in script and "EventSource" not in script.replace("an EventSource cannot", "")


@pytest.mark.parametrize("path", ["/v1/cluster/console", "/v1/cluster/what-if?model=llama-10m", "/v1/cluster/events/stream"])
def test_the_admin_routes_are_a_401_without_a_key_and_a_403_for_a_user_key_in_openais_format(keyed_app, path):
    r = call(path)
    assert r["status"] == 401 and json.loads(r["body"])["error"]["code"] == "invalid_api_key"
    r = call(path, {"authorization": f"Bearer {USER}"})
    assert r["status"] == 403
    err = json.loads(r["body"])["error"]
    assert err["code"] == "permission_denied" and "admin key" in err["message"]


def test_the_endless_event_stream_stays_out_of_the_openapi_schema_that_fuzzers_read():
    paths = app.openapi()["paths"]
    assert "/v1/cluster/what-if" in paths and "/v1/cluster/console" in paths
    assert "/v1/cluster/events/stream" not in paths and "/ui" not in paths
