"""The model-server actor on a real local Ray cluster with real MLX weights: streams (multiplexed on
channels) are coalesced yet identical to the engine's own output, cancelling a stream frees the engine, failures reach the
caller as structured OrchardErrors, and detached named servers are found again and removed
after a drain."""

import os

# Before `import ray` (shared/ray/README.md pitfall 2; token auth as conftest.py sets it).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import asyncio
import pickle
import sys
import threading
import time

import pytest
import ray

from cluster.model_servers import actor_name, create_model_server, find_model_servers, kill_model_server
from cluster.ray_api import NAMESPACE
from deployments.channels import open_channel
from deployments.engines.llm import LLMEngine
from deployments.failures import unwrap
from deployments.manifest import read_manifest
from deployments.wire.failure import STATUS, OrchardError
from deployments.wire.generation import GenerationRequest

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

NODE = "head"  # Orchard's name for the one node of the shared cluster
LLAMA = actor_name("llama-10m", NODE)
PROMPT = "Once upon a time, in a land far away, there lived a"


@pytest.fixture(scope="module")
def ray_node(shared_ray):
    """The shared one-node cluster (tests/support/shared_cluster.py): its head's Ray node id."""
    return shared_ray


@pytest.fixture(scope="module")
def manifest(models_dir):
    return read_manifest(models_dir)


def _start(manifest, models_dir, ray_node, model, options=None):
    started = time.perf_counter()
    handle = create_model_server(manifest.entry(model), NODE, ray_node_id=ray_node, models_dir=models_dir, options=options)
    report = ray.get(handle.load.remote(), timeout=60)
    print(f"\n{model}: actor create + load {time.perf_counter() - started:.2f} s (engine load {report.load_seconds:.2f} s)")
    return handle, report


@pytest.fixture(scope="module")
def llama(ray_node, manifest, models_dir):
    handle, report = _start(manifest, models_dir, ray_node, "llama-10m", {"gil_switch_ms": 0.1})
    yield handle, report
    asyncio.run(kill_model_server(LLAMA, 1.0))


@pytest.fixture(scope="module")
def embedder(ray_node, manifest, models_dir):
    handle, _ = _start(manifest, models_dir, ray_node, "all-minilm-l6-v2")
    yield handle
    asyncio.run(kill_model_server(actor_name("all-minilm-l6-v2", NODE), 1.0))


@pytest.fixture(scope="module")
def local_engine(models_dir):
    """The same model in the test process: the reference output (loads in ~0.1 s)."""
    engine = LLMEngine("llama-10m", str(models_dir / "llama-10m"))
    asyncio.run(engine.load())
    yield engine
    asyncio.run(engine.stop())


def _stream(handle, request: dict) -> tuple[list[dict], list[float]]:
    """All items of one request, submitted on a channel of its own, and the seconds each arrived
    after the submit. A request that fails before any output raises its OrchardError, as the
    ingress does with the channel's failure item."""
    channel = f"one-{time.monotonic_ns()}"
    started = time.perf_counter()
    handle.submit.remote(channel, "r", request)
    stream = open_channel(handle, channel)
    items, times = [], []
    try:
        while not items or items[-1].get("finish_reason") is None:
            for _, item in ray.get(next(stream), timeout=30):
                if isinstance(item, OrchardError):
                    raise item
                items.append(item)
                times.append(time.perf_counter() - started)
    finally:
        ray.cancel(stream)
    return items, times


def _running(handle) -> int:
    health = ray.get(handle.health.remote())
    return max(health.running_requests, health.in_flight)


def _error(call) -> OrchardError:
    with pytest.raises(Exception) as info:
        call()
    return unwrap(info.value)


def test_the_shared_cluster_comes_clean(ray_node):
    """Whatever module used the shared cluster before (test_api_e2e in `make test`) left no model
    server and no operator state behind (conftest resets both between modules)."""
    from ray.experimental import internal_kv as kv

    assert [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE] == []
    assert kv._internal_kv_list("", namespace=NAMESPACE) == []


def test_load_reports_memory_and_health(llama, manifest):
    handle, report = llama
    assert report.weight_bytes == manifest.entry("llama-10m").weight_bytes
    assert report.load_seconds > 0 and report.active_bytes > 0.99 * report.weight_bytes  # file size incl. headers
    health = ray.get(handle.health.remote())
    assert (health.status, health.kind, health.node_id, health.actor_name) == ("ready", "llm", NODE, LLAMA)
    assert ray.get(handle.load.remote()).weight_bytes == report.weight_bytes  # loading twice is harmless
    assert ray.get(handle.memory.remote()).weight_bytes == report.weight_bytes
    # the actor process took the shorter GIL switch interval it was given (the engine thread
    # waits at most that long for the GIL); this test process keeps Python's own
    assert ray.get(handle.__ray_call__.remote(lambda self: sys.getswitchinterval())) == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_stream_is_coalesced_and_equals_the_engine_output(llama, local_engine):
    handle, _ = llama
    request = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    items, times = _stream(handle, request)
    tokens = [t for item in items for t in item["token_ids"]]
    print(f"\n64-token stream: {len(items)} items, first after {times[0] * 1000:.0f} ms, last after {times[-1] * 1000:.0f} ms")
    assert len(tokens) == 64 and len(items) < len(tokens)
    # the first delta goes out alone, before the generation is over
    assert len(items[0]["token_ids"]) == 1 and items[0]["finish_reason"] is None and times[0] < times[-1]
    assert all(item["finish_reason"] is None and item["usage"] is None for item in items[:-1])
    assert items[-1]["finish_reason"] == "length" and items[-1]["usage"]["completion_tokens"] == 64
    reference = asyncio.run(local_engine.complete(GenerationRequest(**request)))
    assert tokens == reference.token_ids
    assert "".join(item["text"] for item in items) == reference.text


def _read_channel(handle, channel_id: str, want: set[str], timeout_s: float = 60.0) -> tuple[dict[str, list[dict]], int]:
    """Every item of the requests in `want` from one channel, until each has ended; and how many
    Ray items (batches) carried them."""
    stream = open_channel(handle, channel_id)
    items: dict[str, list[dict]] = {rid: [] for rid in want}
    batches, open_ = 0, set(want)
    deadline = time.monotonic() + timeout_s
    while open_ and time.monotonic() < deadline:
        batch = ray.get(next(stream), timeout=30)
        batches += 1
        for rid, item in batch:
            items[rid].append(item)
            if isinstance(item, OrchardError) or item.get("finish_reason") is not None:
                open_.discard(rid)
    ray.cancel(stream)
    assert not open_, f"requests never ended: {open_}"
    return items, batches


def test_channel_carries_several_streams_in_one_item_per_flush(llama, local_engine):
    """One channel, four concurrent generations: every stream is exactly the engine's output, and
    far fewer Ray items go out than one per stream per flush; a bad request comes back as a
    failure item on the channel instead of an exception."""
    handle, _ = llama
    prompts = [PROMPT, "The quick brown fox", "In the beginning", "Hello there, my friend"]
    requests = {f"r{i}": {"prompt": p, "max_tokens": 40, "temperature": 0} for i, p in enumerate(prompts)}
    requests["bad"] = {"prompt": PROMPT, "max_tokens": 0}
    for rid, request in requests.items():
        handle.submit.remote("test-channel", rid, request)
    items, batches = _read_channel(handle, "test-channel", set(requests))
    [bad] = items["bad"]
    assert isinstance(bad, OrchardError) and (bad.code, bad.param, bad.retry_after_s) == ("invalid_request", "max_tokens", None)
    per_stream = sum(len(items[rid]) for rid in requests if rid != "bad")
    print(f"\nchannel: {per_stream} stream items in {batches} Ray items")
    assert batches < per_stream
    for rid, request in requests.items():
        if rid == "bad":
            continue
        reference = asyncio.run(local_engine.complete(GenerationRequest(**request)))
        assert [t for item in items[rid] for t in item["token_ids"]] == reference.token_ids
        # not held to the end: the first flush after a stream's first token carries it. Alone only if
        # the channel was free then: with four streams, one's first token may come while another's
        # flush waits for the caller (backpressure 1) and join its next tokens in one item (one
        # stream's first delta alone: test_stream_is_coalesced_and_equals_the_engine_output)
        assert items[rid][0]["finish_reason"] is None and len(items[rid]) > 1
        assert items[rid][-1]["finish_reason"] == "length" and items[rid][-1]["usage"]["completion_tokens"] == 40


def test_channel_cancel_stops_the_generation(llama):
    handle, _ = llama
    never_end = {str(i): -100.0 for i in range(4)}  # no EOS
    handle.submit.remote("cancel-channel", "long", {"prompt": "Keep going", "max_tokens": 2000, "temperature": 0, "logit_bias": never_end})
    stream = open_channel(handle, "cancel-channel")
    first = ray.get(next(stream), timeout=30)
    assert first[0][0] == "long" and first[0][1]["finish_reason"] is None
    assert ray.get(handle.cancel.remote("long")) is True
    deadline = time.monotonic() + 10
    while _running(handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(handle) == 0
    assert ray.get(handle.cancel.remote("long")) is False
    ray.cancel(stream)


def test_constrained_requests_end_once_whether_finished_failed_or_cancelled(llama):
    """A constrained request starts after its grammar compiles (a task of its own); it finishes,
    fails on a bad schema, or is cancelled while compiling or running, and in each case ends exactly
    once: nothing stays counted in flight."""
    handle, _ = llama
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    good = {"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "constraint": {"type": "json_schema", "schema": schema}}
    bad = dict(good, constraint={"type": "json_schema", "schema": {"type": "no-such-type"}})
    stream = open_channel(handle, "constrained")
    handle.submit.remote("constrained", "good", good)
    handle.submit.remote("constrained", "bad", bad)
    # right after its submit ran (Ray does not order an async actor's calls: a cancel sent with the
    # submit could run first and find nothing; the ingress waits for the submit the same way): likely
    # still compiling
    ray.get(handle.submit.remote("constrained", "gone-early", dict(good, max_tokens=2000)))
    handle.cancel.remote("gone-early")
    seen: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 30
    while not ({"good", "bad"} <= {rid for rid, items in seen.items() if isinstance(items[-1], OrchardError) or items[-1].get("finish_reason")}):
        assert time.monotonic() < deadline, seen
        for rid, item in ray.get(next(stream), timeout=30):
            seen.setdefault(rid, []).append(item)
    assert isinstance(seen["bad"][0], OrchardError) and seen["bad"][0].param == "response_format"
    text = "".join(d.get("text") or "" for d in seen["good"])
    assert seen["good"][-1]["finish_reason"] in ("stop", "length") and text.startswith("{")
    deadline = time.monotonic() + 10
    while _running(handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(handle) == 0
    ray.cancel(stream)


def test_closing_a_channel_cancels_its_requests(llama, local_engine):
    """The caller went away (its channel generator is cancelled): every request it had open on the
    channel is cancelled in the engine and its KV freed."""
    handle, _ = llama
    never_end = dict.fromkeys(local_engine.eos_ids, -100.0)  # random weights may pick EOS: forbid it
    handle.submit.remote("closing", "long", {"prompt": "Keep going", "max_tokens": 2000, "temperature": 0, "logit_bias": never_end})
    stream = open_channel(handle, "closing")
    for _ in range(3):
        assert all(item["finish_reason"] is None for _, item in ray.get(next(stream), timeout=30))
    assert _running(handle) == 1
    ray.cancel(stream)
    deadline = time.monotonic() + 5
    while _running(handle) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(handle) == 0
    assert ray.get(handle.memory.remote()).kv_bytes_in_use == 0
    handle.submit.remote("closing", "late", {"prompt": "x", "max_tokens": 2})  # a closed channel takes nothing
    time.sleep(0.5)
    assert _running(handle) == 0


def test_a_whole_generation_is_one_reply_equal_to_the_engines_output(llama, local_engine):
    """generate_whole (a non-streamed request): every delta merged into one reply, the same tokens and
    text as the engine's own, with its usage, the time to its first delta and after; a request the
    engine refuses is its OrchardError as the reply; nothing stays counted once it is answered."""
    handle, _ = llama
    request = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    reply = ray.get(handle.generate_whole.remote("whole-1", request), timeout=60)
    delta = reply.delta
    reference = asyncio.run(local_engine.complete(GenerationRequest(**request)))
    assert delta["token_ids"] == reference.token_ids and delta["text"] == reference.text
    assert delta["finish_reason"] == "length" and delta["usage"]["completion_tokens"] == 48
    assert reply.first_s > 0 and reply.last_s > 0  # 47 more steps after the first
    refused = ray.get(handle.generate_whole.remote("whole-2", {"prompt": "x", "max_tokens": 0}), timeout=30)
    assert isinstance(refused, OrchardError) and (refused.code, refused.param) == ("invalid_request", "max_tokens")
    assert ray.get(handle.progress.remote("whole-1")) is None  # answered: no longer known
    assert _running(handle) == 0


def test_cancelling_a_whole_generation_stops_it_and_progress_tracks_it(llama, local_engine):
    """While a whole generation runs, `progress` says how long since its last delta (short, since it
    produces one each step); ray.cancel of its call (the ingress's, when its client goes away or it
    gives up) cancels the generation in the engine and frees its KV."""
    handle, _ = llama
    never_end = dict.fromkeys(local_engine.eos_ids, -100.0)
    ref = handle.generate_whole.remote("whole-long", {"prompt": "Keep going", "max_tokens": 2000, "temperature": 0, "logit_bias": never_end})
    deadline = time.monotonic() + 30
    while ray.get(handle.progress.remote("whole-long")) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    assert ray.get(handle.progress.remote("whole-long")) < 0.5 and _running(handle) == 1
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    deadline = time.monotonic() + 10
    while _running(handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(handle) == 0 and ray.get(handle.progress.remote("whole-long")) is None
    assert ray.get(handle.memory.remote()).kv_bytes_in_use == 0


def test_a_server_gives_back_its_kept_prompt_prefixes_on_asking(llama, embedder):
    """X4's effect: what the residency loop asks of a node's instances before it evicts for room.
    The LLM's kept prefixes go (the bytes it frees, then none held); an engine that keeps none frees 0."""
    handle, _ = llama
    long_prompt = " ".join(f"word{i}" for i in range(600))  # over prompt_cache_min_tokens: kept after it runs
    ray.get(handle.generate_whole.remote("prefix-1", {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}), timeout=60)
    held = ray.get(handle.memory.remote()).prefix_cache_bytes
    assert held > 0
    assert ray.get(handle.shrink_prefix_cache.remote(0), timeout=30) == held
    assert ray.get(handle.memory.remote()).prefix_cache_bytes == 0
    assert ray.get(embedder.shrink_prefix_cache.remote(0), timeout=30) == 0


def test_embedding_server_returns_vectors(embedder):
    out = ray.get(embedder.embed.remote(["a red apple", "a green pear"]))
    assert out.dimensions == 384 and len(out.vectors) == 2 and out.prompt_tokens > 0
    assert all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in out.vectors)
    assert ray.get(embedder.embed.remote("one text", dimensions=64)).dimensions == 64


def test_failures_reach_the_caller_as_orchard_errors(llama, embedder):
    handle, _ = llama
    bad = _error(lambda: _stream(handle, {"prompt": "x", "max_tokens": 0}))
    # the status is the one table's (deployments/wire/failure.py)
    assert (bad.code, bad.param, STATUS[bad.code]) == ("invalid_request", "max_tokens", 400)
    too_long = _error(lambda: _stream(handle, {"prompt_tokens": [1] * 4096, "max_tokens": 1}))  # a larger max_tokens alone is clamped
    assert too_long.code == "context_length_exceeded"
    assert _error(lambda: _stream(handle, {"prompt_tokens": [10**6], "max_tokens": 2})).code == "invalid_request"
    assert _error(lambda: ray.get(embedder.embed.remote([]))).to_dict()["param"] == "input"
    wrong = _error(lambda: ray.get(handle.embed.remote(["x"])))
    assert (wrong.code, wrong.param) == ("unsupported", "model") and "llama-10m" in wrong.message
    assert _error(lambda: _stream(embedder, {"prompt": "x"})).code == "unsupported"
    assert _error(lambda: ray.get(embedder.speak.remote("hi"))).code == "unsupported"
    # Ray's wrapper is itself an OrchardError with the fields, and the error pickles alone
    with pytest.raises(OrchardError) as info:
        ray.get(handle.rerank.remote("q", ["d"]))
    assert info.value.code == "unsupported"
    again = pickle.loads(pickle.dumps(unwrap(info.value)))
    assert (again.code, again.param) == ("unsupported", "model") and "reranking" in again.message
    assert _running(handle) == 0


def test_a_stopped_servers_failure_arrives_as_the_same_orchard_error_every_way(ray_node, manifest, models_dir):
    """A model server whose engine stopped refuses a generation with engine_stopped, which says a
    retry elsewhere may serve it: the caller gets the same OrchardError (code, param, retry_after_s,
    status) whether it came raised through Ray's wrapper (a call), as a channel's item or as a whole
    generation's reply, and it pickles alone with the same fields."""
    handle = create_model_server(manifest.entry("llama-10m"), NODE, ray_node_id=ray_node, models_dir=models_dir, incarnation="stopped")
    try:
        ray.get(handle.load.remote(), timeout=60)
        ray.get(handle.stop.remote("a test"), timeout=30)
        request = GenerationRequest(prompt="x", max_tokens=2)
        with pytest.raises(OrchardError) as raised:  # Ray's RayTaskError, itself an OrchardError
            ray.get(handle.count_tokens.remote(request), timeout=30)
        on_channel = _error(lambda: _stream(handle, request.model_dump()))
        whole = ray.get(handle.generate_whole.remote("stopped-1", request), timeout=30)
        assert isinstance(whole, OrchardError)
        for error in (unwrap(raised.value), on_channel, whole, pickle.loads(pickle.dumps(whole))):
            assert type(error) is OrchardError
            assert (error.code, error.param, error.retry_after_s, error.status) == ("engine_stopped", None, 1.0, 503)
            assert "llama-10m" in error.message
    finally:
        asyncio.run(kill_model_server(handle, 1.0))


def test_a_missing_model_folder_is_not_found(ray_node):
    ghost = create_model_server(("llm", "ghost", "/nonexistent/ghost"), NODE, ray_node_id=ray_node)
    with pytest.raises(FileNotFoundError) as info:
        ray.get(ghost.load.remote(), timeout=30)
    assert unwrap(info.value).code == "not_found"
    assert asyncio.run(kill_model_server(ghost, 1.0)) == 0
    assert actor_name("ghost", NODE) not in dict(find_model_servers())


def test_a_server_whose_engine_cannot_be_made_fails_with_the_engines_reason(ray_node, manifest, models_dir):
    """An engine option the engine refuses fails the actor's creation with that reason (the actor's
    repr, which Ray asks for when __init__ raises, does not hide it)."""
    bad = create_model_server(
        manifest.entry("llama-10m"), NODE, ray_node_id=ray_node, models_dir=models_dir, options={"engine_options": {"kv_bits": 5}}, incarnation="bad"
    )
    with pytest.raises(Exception) as info:
        ray.get(bad.health.remote(), timeout=60)
    assert "kv_bits" in str(info.value) and "AttributeError" not in str(info.value), str(info.value)[-2000:]


def test_found_again_then_drained_and_killed(llama):
    names = dict(find_model_servers())
    assert LLAMA in names and actor_name("all-minilm-l6-v2", NODE) in names
    fresh = ray.get_actor(LLAMA, namespace=NAMESPACE)
    assert ray.get(fresh.health.remote()).status == "ready"
    with pytest.raises(ValueError, match="already taken"):
        create_model_server(("llm", "llama-10m", "/anywhere"), NODE, ray_node_id=ray.get_runtime_context().get_node_id())

    fresh.submit.remote("draining", "r", {"prompt": PROMPT, "max_tokens": 48, "temperature": 0})
    stream = open_channel(fresh, "draining")
    items: list[dict] = []

    def read():  # as the ingress's reader does, concurrently with the drain
        while not items or (not isinstance(items[-1], OrchardError) and items[-1].get("finish_reason") is None):
            items.extend(item for _, item in ray.get(next(stream), timeout=30))

    reader = threading.Thread(target=read)
    reader.start()
    # Ray does not order an async actor's calls: without this wait the drain could run before the
    # submit, find nothing running and stop the engine under it (seen once in make test).
    deadline = time.monotonic() + 60
    while not items and time.monotonic() < deadline:
        time.sleep(0.01)
    assert items, "no output from the generation to drain"
    # The drain returns as soon as the end was taken; its timeout is only a bound, wide enough for a
    # loaded 2-core machine (at 20 s this test failed when 48 tokens took longer).
    assert asyncio.run(kill_model_server(LLAMA, drain_timeout_s=180)) == 0  # waited until the end was taken
    reader.join(60)
    assert not reader.is_alive()
    assert not isinstance(items[-1], OrchardError), items[-1]  # what went wrong, if it did (seen once in make test)
    assert sum(len(item["token_ids"]) for item in items) == 48 and items[-1]["finish_reason"] == "length"
    with pytest.raises(ValueError):
        ray.get_actor(LLAMA, namespace=NAMESPACE)
    assert LLAMA not in dict(find_model_servers())
    assert asyncio.run(kill_model_server(LLAMA, 1.0)) is None  # already gone


def test_the_operator_store_round_trips_through_the_gcs(ray_node):
    """router.residency.operator_store on a real GCS (this module's one-node cluster): what a restarted
    controller reads back is what the last one wrote; the event window keeps the newest."""
    from deployments.wire.events import ClusterEvent
    from router.residency.operator_store import OperatorStore

    store = OperatorStore(app="store-test", max_events=3)

    async def write() -> None:  # pins and loads are written in order from the controller's event loop (rule X2)
        for done in (
            store.set_pin("a", True),
            store.set_pin("b", False),
            store.add_load("a", "mac-1"),
            store.add_load("b", None),
            store.drop_load("b"),
        ):
            await done

    asyncio.run(write())
    store.add_pull("a", "mac-1")
    store.add_pull("a", "mac-2")
    store.drop_pull("a", "mac-1")
    for seq in range(1, 6):
        store.on_event(ClusterEvent(seq=seq, at=float(seq), kind="pinned", model="a", reason=f"#{seq}"))
    again = OperatorStore(app="store-test", max_events=3)
    assert again.pins() == {"a": True, "b": False}
    assert again.loads() == {"a": "mac-1"}
    assert again.pulls() == [("a", "mac-2")]
    assert [e.seq for e in again.events()] == [3, 4, 5] and again.events()[-1].reason == "#5"
    assert OperatorStore(app="another-app").pins() == {}
