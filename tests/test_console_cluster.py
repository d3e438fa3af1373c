"""The console (issue 29) on a real 2-node Ray cluster with real MLX models and admin / user keys: its
routes through HTTP (what-if changes nothing and answers in the policy's terms; the event stream sends
the log, then each new event as it happens; unknown names are 404s), and the page itself in headless
Chromium (Debian's `chromium`, driven by Playwright): a key entered once, an eviction set off through
the page, and the node bars, the instances and the eviction sentence updated."""

import json
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")
playwright = pytest.importorskip("playwright.sync_api")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from support.cluster import HEALTH, Http, key_entry, node_args, serve_orchard  # noqa: E402

from router.console.demo_cluster import CHROMIUM, CHROMIUM_ARGS  # noqa: E402  (the screenshot tools' browser, as the page is tested)
from router.residency.registry import from_manifest  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
ADMIN, USER = "sk-console-admin", "sk-console-user"
SMALL, BIG = "llama-10m", "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def orchard(models_dir):
    """head (0.7 GiB: llama-10m's 129 MiB and smollm2's 622 MiB do not fit together) + mac-1 (0.5 GiB);
    an admin and a user key; the dashboard's address configured (this cluster runs none)."""
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", 0.7, 2) | {"include_dashboard": False, "_system_config": HEALTH})
    cluster.add_node(**node_args("mac-1", 0.5, 1))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    models = [
        m
        for m in from_manifest(models_dir, {SMALL: {"reserve_context_tokens": 2048}, BIG: {"reserve_context_tokens": 1024}})
        if m["name"] in (SMALL, BIG)
    ]
    base = serve_orchard(
        {
            "models_dir": str(models_dir),
            "models": models,
            "policy": {
                "safety_margin_bytes": 16 * MIB,
                "safety_margin_fraction": 0,
                "instance_overhead_bytes": 64 * MIB,
                "min_residency_s": 0,
                "residency_per_reload": 0,
                "contention": "fail",
            },
            "watch_period_s": 0.5,
            "api_keys": [key_entry("ops", ADMIN, role="admin"), key_entry("team", USER)],
            "dashboard_url": "http://127.0.0.1:8265",
        }
    )
    yield {"base": base, "admin": Http(base, {"Authorization": f"Bearer {ADMIN}"}), "user": Http(base, {"Authorization": f"Bearer {USER}"})}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def last_seq(http: Http) -> int:
    return max(e["seq"] for e in http.get("/v1/cluster/events").json()["data"])


def state(http: Http) -> tuple[int, list[dict]]:
    """The event log's last seq and the nodes, less what is measured rather than decided (the free
    memory a node last reported, its disk's free bytes, the prefix tier's files)."""
    nodes = http.get("/v1/cluster").json()["nodes"]
    for node in nodes:
        node["memory"].pop("headroom_bytes")
        for measured in ("free_bytes", "prefix_bytes"):
            node["store"].pop(measured)
    return last_seq(http), nodes


def settled(http: Http) -> tuple[int, list[dict]]:
    """`state` once two reads half a second apart agree (spares start in the background, rule R1)."""
    previous = None
    for _ in range(120):
        now = state(http)
        if now == previous:
            return now
        previous = now
        time.sleep(0.5)
    raise AssertionError(f"the cluster did not settle: {previous}")


def test_what_if_answers_in_the_policys_terms_and_changes_nothing(orchard):
    admin = orchard["admin"]
    before = settled(admin)
    r = admin.get("/v1/cluster/what-if", params={"model": BIG, "node": "head"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "orchard.what_if" and answer["decision"]["decision"] == "place"
    assert (answer["decision"]["node_id"], answer["decision"]["evict"]) == ("head", [])
    assert answer["words"].startswith(f"load {BIG} on head (cpu, ") and answer["message"] == "fits without eviction"
    r = admin.get("/v1/cluster/what-if", params={"model": BIG, "node": "mac-1"})  # 622 MiB cannot fit in 0.5 GiB
    assert r.status_code == 200 and r.json()["decision"]["decision"] == "reject" and r.json()["words"].startswith(f"refuse {BIG} (")
    assert state(admin) == before  # nothing loaded, nothing recorded


def test_what_if_of_an_unknown_model_or_node_is_a_404_and_a_user_key_a_403(orchard):
    admin = orchard["admin"]
    r = admin.get("/v1/cluster/what-if", params={"model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = admin.get("/v1/cluster/what-if", params={"model": SMALL, "node": "mac-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found" and "mac-1" in r.json()["error"]["message"]
    r = admin.get("/v1/cluster/what-if")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = orchard["user"].get("/v1/cluster/what-if", params={"model": SMALL})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"


def frames_of(response) -> Iterator[tuple[str, dict]]:
    """Each SSE frame of `response` as (event, data), as it arrives (iter_lines would wait for 512 bytes)."""
    kind, data, buffer = "message", [], ""
    for chunk in response.iter_content(chunk_size=None, decode_unicode=True):
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                yield kind, json.loads("\n".join(data))
                kind, data = "message", []


def next_frame(frames: Iterator[tuple[str, dict]], kind: str) -> dict:
    """The next frame of this kind (the stream's 15 s keep-alives bound each wait; Http's read timeout is 120 s)."""
    for got, data in frames:
        if got == kind:
            return data
    raise AssertionError(f"the stream ended before a {kind} event")


def test_the_event_stream_sends_the_log_then_each_new_event_as_it_happens(orchard):
    admin = orchard["admin"]
    seq = last_seq(admin)
    response = admin.get("/v1/cluster/events/stream", params={"since": max(0, seq - 1)}, stream=True)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = frames_of(response)
    try:
        assert next_frame(frames, "cluster_event")["event"]["seq"] == seq  # the log after `since` first
        assert next_frame(frames, "caught_up") == {"last_seq": seq}
        assert admin.post(f"/v1/models/{SMALL}/pin", json={}).status_code == 200
        story = next_frame(frames, "cluster_event")
        assert story["event"]["kind"] == "pinned" and story["event"]["seq"] == seq + 1  # nothing else came between
        assert story["sentence"] == f"{SMALL} was pinned: it is never evicted"
        assert admin.post(f"/v1/models/{SMALL}/unpin", json={}).status_code == 200
        assert next_frame(frames, "cluster_event")["event"]["kind"] == "unpinned"
    finally:
        response.close()


def test_the_page_sets_off_an_eviction_and_shows_the_bars_the_instances_and_the_sentence(orchard):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.set_default_timeout(120_000)
            page.goto(orchard["base"] + "/ui")
            page.wait_for_selector("#notice:has-text('admin key')")  # no key yet: the page asks for one
            page.fill("#key", ADMIN)
            page.click("#key-save")
            page.wait_for_selector(".node[data-node='head'] .bar")
            page.wait_for_selector(".node[data-node='mac-1'] .bar")
            page.wait_for_selector("#live.on")
            assert page.evaluate("sessionStorage.getItem('orchard.adminKey')") == ADMIN and ADMIN not in page.url

            def load(model: str, expect: str) -> None:
                page.select_option("#whatif-model", model)
                page.select_option("#whatif-node", "head")
                page.click("#act-load")
                page.wait_for_selector("#confirm:not([hidden])")
                assert expect in page.text_content("#confirm-text")  # the decision, shown before it is carried out
                page.click("#confirm-go")
                page.wait_for_selector(f"#act-result[data-done='load']:has-text('{model}')")

            load(SMALL, f"load {SMALL} on head (cpu, ")
            page.wait_for_selector(f"#instances tr[data-model='{SMALL}'][data-node='head']")
            page.wait_for_selector(f".node[data-node='head'] .seg.weights[data-model='{SMALL}']")
            load(BIG, f"after evicting {SMALL} from head")

            evicted = page.wait_for_selector(f"#story li[data-kind='evicted'][data-model='{SMALL}']")
            assert f"{SMALL} was evicted from head (" in evicted.text_content() and f"to place {BIG}" in evicted.text_content()
            page.wait_for_selector(f"#instances tr[data-model='{BIG}'][data-node='head']")
            page.wait_for_selector(f"#instances tr[data-model='{SMALL}']", state="detached")
            page.wait_for_selector(f".node[data-node='head'] .seg.weights[data-model='{BIG}']")
            page.wait_for_selector(f".node[data-node='head'] .seg[data-model='{SMALL}']", state="detached")
            assert page.get_attribute(f".node[data-node='head'] .seg.kv[data-model='{BIG}']", "data-bytes") == str(46080 * 1024)
            link = page.get_attribute(f"#instances tr[data-model='{BIG}'] a", "href")
            assert link.startswith("http://127.0.0.1:8265/#/actors/") and len(link) > len("http://127.0.0.1:8265/#/actors/")

            page.select_option("#filter-model", BIG)  # the story filtered to one model
            kinds = page.eval_on_selector_all("#story li", "items => items.map(i => i.dataset.model)")
            assert kinds and set(kinds) == {BIG}
        finally:
            browser.close()
