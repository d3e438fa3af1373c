"""Weights follow placement, end to end on a real 2-node Ray cluster: each node has its own model
store (ORCHARD_STORE); only the head's holds the model. Placing it on mac-1 copies the folder there
from the head's node agent over their direct stream (cluster/stream.py), every file's sha256 checked; the copy answers exactly as the
original; a second placement finds it stored; an operator pull copies without loading and a stored
copy can be removed (never one in use, nor the last without force); a source whose file went bad
fails the copy with the reason and leaves no folder behind; a hub model is downloaded into the store
by huggingface_hub's own client (from a stand-in Hub on 127.0.0.1, tests/support/hub_server.py), then
copied node to node, not downloaded again."""

import hashlib
import json
import shutil
import socket
import time

import pytest

ray = pytest.importorskip("ray")
import openai  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from support.cluster import Http, free_port, node_args, wait_for  # noqa: E402
from support.hub_server import SHA, Hub  # noqa: E402

from cluster.model_servers import live_model_server_names  # noqa: E402
from cluster.node_agent import get_agent  # noqa: E402
from cluster.store import ENV_STORE, PARTIAL, Store  # noqa: E402
from cluster.stored import MANIFEST  # noqa: E402
from cluster.stream import FileRange, StreamReply, StreamRequest, recv_message, send_message  # noqa: E402
from router.api.builder import build_app  # noqa: E402
from router.residency.registry import from_manifest  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2


HUB_REPO = "orchard-test/llama-10m"


@pytest.fixture(scope="module")
def hub(models_dir):
    with Hub({HUB_REPO: models_dir / "llama-10m"}) as server:
        yield server


@pytest.fixture(scope="module")
def orchard(models_dir, tmp_path_factory, hub):
    root = tmp_path_factory.mktemp("stores")
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(root / "hf-home")}
    stores = {"head": root / "head", "mac-1": root / "mac-1", "mac-2": root / "mac-2"}
    shutil.copytree(models_dir / "llama-10m", stores["head"] / "llama-10m")
    shutil.copytree(models_dir / "llama-10m", stores["head"] / "llama-bad")
    shutil.copytree(models_dir / "llama-10m", stores["head"] / "llama-slow")
    stores["mac-1"].mkdir()
    for holder in ("head", "mac-2"):  # two holders of llama-two: a copy can go on from the second
        shutil.copytree(models_dir / "llama-10m", stores[holder] / "llama-two")
    head = node_args("head", 1.0, 2) | {"include_dashboard": False, "env_vars": {ENV_STORE: str(stores["head"])} | hub_env}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(**node_args("mac-1", 0.6, 1) | {"env_vars": {ENV_STORE: str(stores["mac-1"])} | hub_env})
    mac2 = node_args("mac-2", 0.2, 1)
    mac2["labels"]["orchard.disk_budget_gib"] = "0.06"  # ~64 MB: room for one copy of llama-10m and a bit
    cluster.add_node(**mac2 | {"env_vars": {ENV_STORE: str(stores["mac-2"])} | hub_env})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    llama = next(m for m in from_manifest(models_dir, {"llama-10m": {"reserve_context_tokens": 2048}}) if m["name"] == "llama-10m")
    from_hub = {k: v for k, v in llama.items() if k != "path"} | {"name": "llama-hub", "hub_id": HUB_REPO}
    slow = llama | {"name": "llama-slow", "path": "llama-slow", "policy": llama.get("policy", {}) | {"allowed_nodes": ["mac-1"]}}
    two = slow | {"name": "llama-two", "path": "llama-two"}
    models = [llama, llama | {"name": "llama-bad", "path": "llama-bad"}, from_hub, slow, two]
    # no models_dir holds anything: a node loads from its own store or not at all
    policy = {
        "min_residency_s": 0,
        "residency_per_reload": 0,
        "safety_margin_bytes": 16 * MIB,
        "safety_margin_fraction": 0,
        "instance_overhead_bytes": 64 * MIB,
    }
    # copies capped at 10 MB/s (AppArgs.fetch_max_bytes_per_s): a copy of llama-10m takes ~4 s, long
    # enough to disconnect a client in the middle of one
    args = {"models_dir": str(root / "nowhere"), "models": models, "policy": policy, "watch_period_s": 0.5, "fetch_max_bytes_per_s": 10e6}
    serve.run(build_app(args), name="orchard", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"http": Http(base), "client": client, "stores": stores, "models_dir": models_dir, "args": args}
    ray.shutdown()  # the whole cluster goes: Serve's graceful drain first would only add ~5 s
    cluster.shutdown()


def events(orchard, model: str) -> list[dict]:
    return [e for e in orchard["http"].get("/v1/cluster/events").json()["data"] if e["model"] == model]


def answer(orchard, model: str) -> str:
    reply = orchard["client"].completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    return reply.choices[0].text


def model(orchard, name: str) -> dict:
    return orchard["http"].get(f"/v1/models/{name}").json()["orchard"]


def test_count_tokens_reads_a_stores_tokenizer_and_fetches_nothing(orchard):
    """count_tokens of a model that is not loaded: the head's agent counts with the tokenizer of the
    folder in its store (models_dir holds nothing here), nothing is loaded or copied; a hub model no
    store holds yet is Anthropic's 404, not a download."""
    http = orchard["http"]
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "system": "Tell a story."}
    r = http.post("/v1/messages/count_tokens", json=body | {"model": "llama-10m"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 5, r.text
    r = http.post("/v1/messages/count_tokens", json=body | {"model": "llama-hub"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "loads nothing" in r.json()["error"]["message"], r.text
    assert model(orchard, "llama-10m")["status"] == "available" and model(orchard, "llama-10m")["stored_on"] == ["head"]
    assert not [e for name in ("llama-10m", "llama-hub") for e in events(orchard, name) if e["kind"] in ("placed", "loading", "fetching")]


def test_a_pull_copies_to_a_store_without_loading_and_a_copy_can_be_removed(orchard):
    http = orchard["http"]
    r = http.post("/v1/models/llama-10m/pull", json={"nodes": ["mac-1", "head"]})  # not mac-2: its store stays as it is
    assert r.status_code == 200 and r.json()["nodes"] == {"mac-1": "fetching", "head": "stored"}, r.text
    wait_for(lambda: model(orchard, "llama-10m")["stored_on"] == ["head", "mac-1"], 60, "the pulled copy on mac-1")
    assert model(orchard, "llama-10m")["status"] == "available"  # stored, not loaded
    assert any(e["kind"] == "fetched" and e["node_id"] == "mac-1" for e in events(orchard, "llama-10m"))
    r = http.delete("/v1/models/llama-10m/files?node=mac-1")
    assert r.status_code == 200 and r.json()["removed"] is True, r.text
    assert not (orchard["stores"]["mac-1"] / "llama-10m").exists() and model(orchard, "llama-10m")["stored_on"] == ["head"]
    r = http.delete("/v1/models/llama-10m/files?node=head")
    assert r.status_code == 409 and r.json()["error"]["code"] == "last_stored_copy", r.text
    r = http.delete("/v1/models/llama-10m/files?node=mac-1")
    assert r.status_code == 404 and r.json()["error"]["code"] == "files_not_stored", r.text
    assert http.post("/v1/models/llama-10m/pull", json={"nodes": ["mac-9"]}).status_code == 404


def test_a_copy_between_agents_goes_over_their_direct_stream(orchard):
    """The head's agent streams llama-10m to mac-1's on the head's node address (127.0.0.1 here),
    behind a one-time ticket that only the Ray call which opened the stream returned."""
    manifest = ray.get(get_agent("head").manifest.remote("llama-10m"))
    result = ray.get(get_agent("mac-1").fetch.remote(manifest, ["head"]))
    total = sum(f["size"] for f in manifest["files"])
    assert result["ok"] and result["transport"] == "tcp" and result["bytes"] == result["total_bytes"] == total, result
    assert result["source"] == "head" and result["removed"] == [] and "fallback" not in result
    assert Store(orchard["stores"]["mac-1"]).manifest("llama-10m") is not None
    offer = ray.get(get_agent("head").open_stream.remote("llama-10m"))
    assert offer.host == "127.0.0.1" and len(offer.ticket) >= 43
    with socket.create_connection((offer.host, offer.port), timeout=10) as conn:  # a stranger with a guessed ticket
        send_message(conn, StreamRequest(ticket="x" * 43, folder="llama-10m", files=(FileRange(path="model.safetensors", offset=0),)))
        reply = StreamReply.model_validate_json(recv_message(conn))
        assert not reply.ok and reply.code == "forbidden" and conn.recv(1 << 16) == b""
    assert ray.get(get_agent("mac-1").remove.remote("llama-10m"))["removed"]  # the next test copies it again


def test_a_model_placed_where_its_weights_are_not_is_copied_from_the_holder(orchard):
    http, stores = orchard["http"], orchard["stores"]
    r = http.post("/v1/models/llama-10m/load", json={"node": "mac-1"})
    assert r.status_code == 200, r.text
    source, copy = stores["head"] / "llama-10m", stores["mac-1"] / "llama-10m"
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert files and all(hashlib.sha256((source / f).read_bytes()).digest() == hashlib.sha256((copy / f).read_bytes()).digest() for f in files)
    assert (copy / MANIFEST).is_file() and not (stores["mac-1"] / PARTIAL / "llama-10m").exists()
    kinds = {e["kind"]: e for e in events(orchard, "llama-10m")}
    total = sum((source / f).stat().st_size for f in files)
    assert kinds["fetching"]["node_id"] == "mac-1" and "from head" in kinds["fetching"]["reason"]
    assert kinds["fetched"]["bytes"] == total and kinds["fetched"]["seconds"] > 0 and "MB/s" in kinds["fetched"]["reason"]
    nodes = {n["node_id"]: n for n in http.get("/v1/cluster").json()["nodes"]}
    assert nodes["mac-1"]["store"]["complete"]["llama-10m"] == total
    on_mac = answer(orchard, "llama-10m")
    assert http.post("/v1/models/llama-10m/unload").status_code == 200
    assert http.post("/v1/models/llama-10m/load", json={"node": "head"}).status_code == 200
    assert answer(orchard, "llama-10m") == on_mac  # the copy is the same model


def test_a_second_placement_finds_the_copy_stored(orchard):
    http = orchard["http"]
    before = sum(1 for e in events(orchard, "llama-10m") if e["kind"] == "fetching")
    assert http.post("/v1/models/llama-10m/unload").status_code == 200
    assert http.post("/v1/models/llama-10m/load", json={"node": "mac-1"}).status_code == 200
    assert sum(1 for e in events(orchard, "llama-10m") if e["kind"] == "fetching") == before
    manifest = ray.get(get_agent("head").manifest.remote("llama-10m"))  # asked again from a stale view: nothing copied
    assert ray.get(get_agent("mac-1").fetch.remote(manifest, ["head"]))["bytes"] == 0
    r = orchard["http"].delete("/v1/models/llama-10m/files?node=mac-1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "files_in_use" and "unload first" in r.json()["error"]["message"]


def damage(store, folder: str) -> None:
    """Seal `folder` while it is good, then flip one byte in the middle of its weights (same size): a
    copy of it fails its sha256 check, while the folder itself still loads."""
    Store(store).seal(folder)
    weights = store / folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def test_a_source_whose_file_went_bad_fails_the_copy_with_the_reason_and_no_folder(orchard):
    http, stores = orchard["http"], orchard["stores"]
    damage(stores["head"], "llama-bad")
    r = http.post("/v1/models/llama-bad/load", json={"node": "mac-1"})
    assert r.status_code == 503, r.text
    assert "sha256" in r.json()["error"]["message"]
    failed = [e for e in events(orchard, "llama-bad") if e["kind"] == "fetch_failed"]
    assert failed and failed[0]["node_id"] == "mac-1" and failed[0]["reason"].startswith("checksum")
    assert not (stores["mac-1"] / "llama-bad").exists()
    assert answer(orchard, "llama-10m")  # the model that was loaded is untouched


def test_a_hub_model_is_downloaded_into_the_store_then_copied_between_nodes(orchard, hub):
    http, stores = orchard["http"], orchard["stores"]
    folder = "models--orchard-test--llama-10m"
    r = http.post("/v1/models/llama-hub/load", json={"node": "mac-1"})
    assert r.status_code == 200, r.text
    manifest = Store(stores["mac-1"]).manifest(folder)
    assert manifest is not None and manifest.source == f"hub:{HUB_REPO}" and manifest.revision == SHA
    for f in manifest.files:  # every file as the Hub served it
        assert hashlib.sha256((orchard["models_dir"] / "llama-10m" / f.path).read_bytes()).hexdigest() == f.sha256
    fetched = [e for e in events(orchard, "llama-hub") if e["kind"] == "fetched"]
    assert fetched and fetched[-1]["node_id"] == "mac-1" and "from the Hub" in fetched[-1]["reason"]
    downloads = sum(1 for method, path in hub.requests if method == "GET" and path.endswith("/model.safetensors"))
    assert downloads == 1
    hub_answer = answer(orchard, "llama-hub")
    assert http.post("/v1/models/llama-hub/unload").status_code == 200
    assert http.post("/v1/models/llama-hub/load", json={"node": "head"}).status_code == 200
    assert sum(1 for method, path in hub.requests if method == "GET" and path.endswith("/model.safetensors")) == downloads  # copied from mac-1
    assert "from mac-1" in [e for e in events(orchard, "llama-hub") if e["kind"] == "fetched"][-1]["reason"]
    assert answer(orchard, "llama-hub") == hub_answer == answer(orchard, "llama-10m")  # the same weights, however they came


def test_a_client_gone_during_a_copy_cancels_it_and_the_next_request_resumes_it(orchard):
    """llama-slow may only go to mac-1, whose store lacks it: a request starts the copy; the client
    hangs up while it runs. The copy is cancelled (event, reservation released, no model server),
    its partial files stay; the next request resumes from them."""
    http, stores = orchard["http"], orchard["stores"]
    host, port = http.base.removeprefix("http://").split(":")
    body = json.dumps({"model": "llama-slow", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
    client = socket.create_connection((host, int(port)))
    client.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_for(lambda: model(orchard, "llama-slow")["fetching"].get("mac-1", {}).get("done_bytes", 0) > 0, 30, "the copy to mac-1 under way")
    client.close()  # the client hangs up mid-copy
    cancelled = wait_for(lambda: [e for e in events(orchard, "llama-slow") if e["kind"] == "cancelled"], 30, "the cancelled event")
    assert cancelled[0]["node_id"] == "mac-1" and "went away" in cancelled[0]["reason"]
    wait_for(lambda: not model(orchard, "llama-slow")["fetching"], 30, "the copy to stop")
    nodes = {n["node_id"]: n for n in http.get("/v1/cluster").json()["nodes"]}
    assert all(i["model"] != "llama-slow" for i in nodes["mac-1"]["instances"])  # its reservation is gone
    assert not any("llama-slow" in name for name in live_model_server_names())
    kept = sum(p.stat().st_size for p in (stores["mac-1"] / PARTIAL / "llama-slow").rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in (stores["head"] / "llama-slow").rglob("*") if p.is_file() and p.name != MANIFEST)
    assert 0 < kept < total and not (stores["mac-1"] / "llama-slow").exists()
    assert answer(orchard, "llama-slow")  # a second client: served, from the resumed copy
    fetched = [e for e in events(orchard, "llama-slow") if e["kind"] == "fetched"][-1]
    assert fetched["bytes"] <= total - kept  # only what the cancelled copy had not written


def test_a_source_that_dies_mid_copy_is_replaced_by_the_next_holder_resuming(orchard):
    """llama-two is in the stores of head and mac-2; the copy to mac-1 reads from head first. Head's
    node agent is killed in the middle: the copy goes on from mac-2, from where it was."""
    http = orchard["http"]
    loading = __import__("threading").Thread(target=lambda: http.post("/v1/models/llama-two/load", json={"node": "mac-1"}))
    loading.start()
    progress = wait_for(lambda: model(orchard, "llama-two")["fetching"].get("mac-1"), 30, "the copy to mac-1 under way")
    assert progress["source"] == "head"
    wait_for(lambda: model(orchard, "llama-two")["fetching"].get("mac-1", {}).get("done_bytes", 0) > 0, 30, "some bytes copied")
    ray.kill(ray.get_actor("orchard-agent:head", namespace="orchard"), no_restart=True)
    loading.join(120)
    fetched = [e for e in events(orchard, "llama-two") if e["kind"] == "fetched"]
    assert fetched and "from mac-2" in fetched[-1]["reason"], [(e["kind"], e["reason"]) for e in events(orchard, "llama-two")]
    copied, total = (int(x) for x in fetched[-1]["reason"].split(": ")[1].split(" bytes")[0].split(" of "))
    assert 0 < copied < total  # resumed: the bytes head had sent were not copied again
    assert Store(orchard["stores"]["mac-1"]).manifest("llama-two") is not None
    assert answer(orchard, "llama-two")


def test_the_disk_budget_makes_room_from_unused_folders_never_from_one_in_use(orchard):
    """mac-2's store may hold ~64 MB and holds llama-two (38 MB), unused there. Pulling llama-10m
    removes llama-two to make room; with llama-10m loaded there, a pull of llama-slow finds nothing
    it may remove and fails saying so."""
    http, stores = orchard["http"], orchard["stores"]
    assert http.post("/v1/models/llama-10m/pull", json={"nodes": ["mac-2"]}).status_code == 200
    wait_for(lambda: "mac-2" in model(orchard, "llama-10m")["stored_on"], 60, "llama-10m stored on mac-2")
    removed = [e for e in events(orchard, "llama-two") if e["kind"] == "files_removed"]
    assert removed and removed[-1]["node_id"] == "mac-2" and "disk budget" in removed[-1]["reason"] and "llama-10m" in removed[-1]["reason"]
    assert not (stores["mac-2"] / "llama-two").exists()
    assert http.post("/v1/models/llama-10m/unload").status_code == 200
    assert http.post("/v1/models/llama-10m/load", json={"node": "mac-2"}).status_code == 200
    assert http.post("/v1/models/llama-slow/pull", json={"nodes": ["mac-2"]}).status_code == 200
    failed = wait_for(
        lambda: [e for e in events(orchard, "llama-slow") if e["kind"] == "fetch_failed" and e["node_id"] == "mac-2"], 60, "the refusal"
    )
    assert failed[-1]["reason"].startswith("disk_full") and "in use there: llama-10m" in failed[-1]["reason"]
    assert (stores["mac-2"] / "llama-10m").exists() and answer(orchard, "llama-10m")
    nodes = {n["node_id"]: n for n in http.get("/v1/cluster").json()["nodes"]}
    assert nodes["mac-2"]["store"]["budget_bytes"] == int(0.06 * 1024**3)


def test_bytes_fetched_are_counted_by_source_in_rays_metrics(orchard):
    import requests

    head = next(n for n in ray.nodes() if n["Alive"] and n["Labels"].get("orchard.node") == "head")
    url = f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"

    def series() -> dict[str, float]:
        lines = [line for line in requests.get(url, timeout=10).text.splitlines() if line.startswith("ray_orchard_fetch_bytes_total{")]
        return {src: sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'source="{src}"' in line) for src in ("peer", "hub")}

    counted = wait_for(lambda: (s := series())["hub"] > 0 and s["peer"] > 0 and s, 60, "fetch byte counters for both sources")
    assert counted["hub"] >= 37_000_000 and counted["peer"] >= 37_000_000  # at least one whole llama-10m each


def test_background_copies_bring_a_requested_model_to_the_stores_with_room(orchard):
    """Rule L4 end to end (runs last: it redeploys with background_copies on). Requests for a model
    only the head's store holds make the residency service copy it into mac-1's store, with no
    placement there and nothing removed; mac-2, whose disk budget is over the half background copies
    may fill, gets none."""
    http, stores, args = orchard["http"], orchard["stores"], orchard["args"]
    for folder in ("llama-warm", "llama-sour"):
        shutil.copytree(orchard["models_dir"] / "llama-10m", stores["head"] / folder)
    damage(stores["head"], "llama-sour")  # its own damaged folder: this test needs no earlier one
    warm = args["models"][0] | {"name": "llama-warm", "path": "llama-warm"}
    sour = args["models"][0] | {"name": "llama-sour", "path": "llama-sour"}
    policy = args["policy"] | {"background_copies": "requested", "background_copy_disk_reserve_bytes": 0}
    serve.run(build_app(args | {"models": [*args["models"], warm, sour], "policy": policy}), name="orchard", route_prefix="/")
    for m in http.get("/v1/models").json()["data"]:
        if m["orchard"]["nodes"]:
            assert http.post(f"/v1/models/{m['id']}/unload").status_code == 200
    since = max((e["seq"] for e in http.get("/v1/cluster/events").json()["data"]), default=0)
    assert answer(orchard, "llama-warm") and answer(orchard, "llama-warm")
    wait_for(lambda: "mac-1" in model(orchard, "llama-warm")["stored_on"], 60, "the background copy on mac-1")
    copied = [e for e in events(orchard, "llama-warm") if e["kind"] == "fetching"]
    assert [e["node_id"] for e in copied] == ["mac-1"] and "background copy, L4: 2.0 requests" in copied[0]["reason"], copied
    assert model(orchard, "llama-warm")["nodes"] == ["head"]  # copied, not placed
    assert 1.9 < model(orchard, "llama-warm")["demand"] <= 2.0  # the two requests, as GET /v1/models shows them
    assert (stores["mac-1"] / "llama-warm" / MANIFEST).stat().st_mtime == 0  # the first to go under a disk budget
    wait_for(lambda: not model(orchard, "llama-warm").get("fetching"), 30, "no copy in flight")
    later = [e for e in http.get("/v1/cluster/events").json()["data"] if e["seq"] > since]
    assert not any(e["kind"] == "files_removed" for e in later)
    assert not any(e["kind"] == "fetching" and e["node_id"] == "mac-2" for e in later)

    # A background copy that fails: llama-sour's folder on the head was damaged after it was sealed,
    # so its copy to mac-1 fails its checksum. The failure is an event with the reason, leaves no
    # folder, and is not tried on that node again within background_copy_retry_s.
    assert http.post("/v1/models/llama-warm/unload").status_code == 200  # the head has room to load llama-sour
    for _ in range(2):  # placed on the head, which stores it: requests that give llama-sour its demand
        orchard["client"].completions.create(model="llama-sour", prompt="Once upon a time", max_tokens=4, temperature=0)

    def sour_on_mac1() -> list[dict]:
        return [e for e in events(orchard, "llama-sour") if e["node_id"] == "mac-1"]

    wait_for(lambda: any(e["kind"] == "fetch_failed" for e in sour_on_mac1()), 60, "llama-sour's background copy failing on mac-1")
    time.sleep(3)  # six watcher periods: a retry, if there were one, would have started
    tried = sour_on_mac1()
    assert [e["kind"] for e in tried] == ["fetching", "fetch_failed"], tried
    assert "background copy, L4" in tried[0]["reason"] and tried[1]["reason"].startswith("checksum"), tried
    assert not (stores["mac-1"] / "llama-sour").exists()
    assert model(orchard, "llama-sour")["nodes"] == ["head"]  # the failed copy cost no placement
