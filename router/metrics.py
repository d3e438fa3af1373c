"""Orchard's Ray metrics (ray.util.metrics): exported per node with a `ray_` prefix at the node's
metrics port, and shown by the Ray dashboard's Metrics page when Prometheus/Grafana are attached.

The residency service feeds placement events and node readings; the ingress feeds request
latency and tokens. Metric objects are created lazily, in the process that uses them."""

from functools import cache

from ray.util import metrics

from deployments.wire.events import ClusterEvent

MODEL_NODE = ("model", "node")


def _tag(value: str | None) -> str:
    """Ray's metric tags are ASCII (a non-ASCII value raises UnicodeEncodeError in the recorder)."""
    return (value or "").encode("ascii", "backslashreplace").decode("ascii")


def _seconds(name: str, description: str, boundaries: list[float]) -> metrics.Histogram:
    """A histogram of seconds, per model."""
    return metrics.Histogram(name, description, boundaries=boundaries, tag_keys=("model",))


@cache
def _m():
    return {
        "instances": metrics.Gauge("orchard_instances_loaded", "Model instances on a node", tag_keys=("node",)),
        "headroom": metrics.Gauge("orchard_node_headroom_bytes", "Free memory Orchard may still use on a node", tag_keys=("node",)),
        "usable": metrics.Gauge("orchard_node_usable_bytes", "Memory Orchard may use on a node", tag_keys=("node",)),
        "loads": metrics.Counter("orchard_loads_total", "Model instances loaded", tag_keys=MODEL_NODE),
        "load_failures": metrics.Counter("orchard_load_failures_total", "Loads that failed", tag_keys=MODEL_NODE),
        "evictions": metrics.Counter("orchard_evictions_total", "Instances evicted to make room", tag_keys=(*MODEL_NODE, "reason")),
        "unloads": metrics.Counter("orchard_unloads_total", "Instances unloaded (idle, operator, node death)", tag_keys=(*MODEL_NODE, "reason")),
        "deaths": metrics.Counter("orchard_instance_deaths_total", "Instances whose actor died on its own", tag_keys=MODEL_NODE),
        "instance_bytes": metrics.Gauge("orchard_instance_bytes", "Memory a loaded instance holds (weights + KV reservation)", tag_keys=MODEL_NODE),
        "requests": metrics.Counter("orchard_requests_total", "Generation requests served through the ingress", tag_keys=("model",)),
        "inter_token": _seconds(
            "orchard_inter_token_seconds",
            "Mean time between tokens of a request after its first, through the ingress",
            [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1],
        ),
        "queue_wait": _seconds(
            "orchard_queue_wait_seconds",
            "Time a request waited for its lease (placement, loading, busy instances)",
            [0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120],
        ),
        "rejections": metrics.Counter("orchard_rejections_total", "Requests the policy could not place", tag_keys=("model",)),
        "load_seconds": _seconds("orchard_load_seconds", "Seconds to load a model instance", [0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300]),
        "ttft": _seconds("orchard_ttft_seconds", "Request to first token, through the ingress", [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30]),
        "tokens": metrics.Counter("orchard_generated_tokens_total", "Completion tokens streamed", tag_keys=("model",)),
        "limit_hits": metrics.Counter("orchard_rate_limited_total", "Requests refused by a key's limit", tag_keys=("limit", "key")),
        "fetch_bytes": metrics.Counter(
            "orchard_fetch_bytes_total", "Bytes of weights copied into a node's store, by source (peer, hub)", tag_keys=(*MODEL_NODE, "source")
        ),
        "fetch_failures": metrics.Counter("orchard_fetch_failures_total", "Copies or downloads of weights that failed", tag_keys=MODEL_NODE),
        "affinity": metrics.Counter(
            "orchard_prefix_affinity_total",
            "Requests routed through standing leases by their prompt's known prefix: hit, overloaded (sent elsewhere for load), miss",
            tag_keys=("model", "outcome"),
        ),
    }


def on_event(event: ClusterEvent) -> None:
    """Count placement events (RayEffects publishes every controller event here)."""
    m = _m()
    tags = {"model": _tag(event.model), "node": _tag(event.node_id)}
    if event.kind == "loaded":
        m["loads"].inc(tags=tags)
        if event.seconds is not None:
            m["load_seconds"].observe(event.seconds, tags={"model": tags["model"]})
    elif event.kind == "load_failed":
        m["load_failures"].inc(tags=tags)
    elif event.kind == "evicted":
        m["evictions"].inc(tags=tags | {"reason": event.cause or "placement"})
    elif event.kind == "unloaded":
        m["unloads"].inc(tags=tags | {"reason": event.cause or "other"})
    elif event.kind == "died":
        m["deaths"].inc(tags=tags)
    elif event.kind == "rejected":
        m["rejections"].inc(tags={"model": tags["model"]})
    elif event.kind == "fetched" and event.bytes:
        m["fetch_bytes"].inc(event.bytes, tags=tags | {"source": event.cause or "peer"})
    elif event.kind == "fetch_failed":
        m["fetch_failures"].inc(tags=tags)


def on_nodes(nodes) -> None:
    """Gauges from the controller's node view (policy NodeStates)."""
    m = _m()
    for n in nodes:
        for inst in n.instances if n.alive else ():
            m["instance_bytes"].set(inst.bytes, tags={"model": _tag(inst.model), "node": _tag(n.node_id)})
        tags = {"node": _tag(n.node_id)}
        m["instances"].set(len(n.instances) if n.alive else 0, tags=tags)
        m["usable"].set(n.usable_bytes if n.alive else 0, tags=tags)
        if n.reported_headroom_bytes is not None:
            m["headroom"].set(max(0, n.reported_headroom_bytes) if n.alive else 0, tags=tags)


def on_request(model: str, ttft_s: float | None, tokens: int, seconds: float | None = None) -> None:
    """A generation that ended: its time to first token, its tokens and (with `seconds`, its whole
    time) the mean gap between its tokens after the first."""
    m = _m()
    m["requests"].inc(tags={"model": _tag(model)})
    if seconds is not None and ttft_s is not None and tokens > 1:
        m["inter_token"].observe(max(0.0, seconds - ttft_s) / (tokens - 1), tags={"model": _tag(model)})
    if ttft_s is not None:
        m["ttft"].observe(ttft_s, tags={"model": _tag(model)})
    if tokens:
        m["tokens"].inc(tokens, tags={"model": _tag(model)})


def on_limit(limit: str, key: str) -> None:
    """A request refused by its key's `limit` (rpm, tpm, max_concurrent); `key` is the key's name."""
    _m()["limit_hits"].inc(tags={"limit": limit, "key": _tag(key)})


def on_affinity(model: str, outcome: str) -> None:
    """A request an ingress routed by prefix affinity (router/serving/affinity.py `outcome`)."""
    _m()["affinity"].inc(tags={"model": _tag(model), "outcome": outcome})


def on_queue_wait(model: str, seconds: float) -> None:
    _m()["queue_wait"].observe(seconds, tags={"model": _tag(model)})
