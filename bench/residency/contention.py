"""`python -m bench.residency.contention` (make bench-contention): three models that fit two at a
time, under steady load from streaming clients (issue 26 item 7). Prints a table, writes JSON.

The cluster: a local Ray cluster started by this process (ray.cluster_utils), a head that holds no
model (a budget of 0.25 GiB) and two worker nodes of 2 GiB each. The models: the embedded llama-10m
registered three times, as m1, m2 and m3, each declaring 1.5 GiB of weights, so that (with the
policy's margin and per-instance overhead, checked and printed before anything starts) one fits on
a worker node and two do not: two of the three are resident at a time, one per node. Policy:
`contention: wait`, `wait_timeout_s: 20`, the rest at its defaults (min_residency_s 10,
swap_after_s 2) except a small safety margin and overhead (a 2 GiB node keeps 512 MiB + 2% free by
default, which leaves no room for 1.5 GiB of weights).

The load: N closed-loop clients (aiohttp, one session), client i asking for m{i % 3 + 1}, each
sending a streaming /v1/completions (a short prompt, greedy, `max_tokens` tokens with the end of
text forbidden so every served request is as long) as soon as its last one ended, for `--seconds`;
a request started before the end runs to its own end. Per request: the model, the HTTP status or
the error code of its body (or of an error event in the stream), the time to the first token and
the total time. The cluster's events (GET /v1/cluster/events) are read every 2 s while it runs.

Variants, one after another, each on a fresh cluster (a fresh Serve app alone would keep the model
servers of the one before: they are detached actors, and the residency service adopts them):
`noswap` (`max_swaps_per_node_per_minute: 0`, the residency loop before swaps, the baseline) and `swaps`
(rules W1-W3 at their defaults). Each variant's Ray logs stay in its session folder (printed, and
in the JSON) for a look at the residency service's log afterwards.

The last line: `served <fraction> min-share <ratio>` of the `swaps` variant, where the share of a
model is its served requests against an even share of all served requests (the goal: >= 0.99 and
>= 0.6)."""

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.environment import SERVE_ENV, session_token_env
from cluster.ports import free_port  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
for _k, _v in SERVE_ENV.items():  # the product's Serve mode
    os.environ.setdefault(_k, _v)

import aiohttp  # noqa: E402
import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from bench.report import publish  # noqa: E402
from bench.sse import Chunks  # noqa: E402
from deployments.models import prepare  # noqa: E402
from policy.cluster_state import NodeState  # noqa: E402
from policy.config import GIB, MIB, PolicyConfig  # noqa: E402
from policy.memory import ever_available_bytes, required_bytes  # noqa: E402
from router.api.builder import build_app  # noqa: E402
from router.residency.registry import from_config  # noqa: E402

MODELS = ("m1", "m2", "m3")
WEIGHT_BYTES = "1.5GiB"
NODE_GIB = 2.0
HEAD_GIB = 0.25
WORKERS = ("mac-1", "mac-2")
BASE_POLICY: dict[str, Any] = {
    "contention": "wait",
    "wait_timeout_s": 20,
    "safety_margin_bytes": "64MiB",
    "safety_margin_fraction": 0,
    "instance_overhead_bytes": "128MiB",
}
VARIANTS: dict[str, dict[str, Any]] = {"noswap": {"max_swaps_per_node_per_minute": 0}, "swaps": {}}
GAVE_UP = ("model_gave_up", "model_busy")
NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): every request runs to max_tokens
PROMPT = "Once upon a time"
EVENT_KINDS = ("waiting", "draining", "cancelled", "evicted", "loaded", "gave_up", "load_failed", "rejected", "died")


def registry() -> list[dict]:
    return [{"name": m, "kind": "llm", "path": "llama-10m", "weight_bytes": WEIGHT_BYTES} for m in MODELS]


def sizes(models_dir: Path, policy: dict) -> dict[str, Any]:
    """What one instance reserves and what each node can give, by the policy's own arithmetic; a
    ValueError unless exactly one model fits on each worker node and none on the head."""
    catalog, _ = from_config(registry(), models_dir)
    config = PolicyConfig.model_validate(policy)
    need = required_bytes(catalog[MODELS[0]], config)

    def room(gib: float) -> int:
        budget = int(gib * GIB)
        return ever_available_bytes(NodeState(node_id="n", total_bytes=budget, usable_bytes=budget), config)

    head, node = room(HEAD_GIB), room(NODE_GIB)
    if not (need <= node < 2 * need and head < need):
        raise ValueError(
            f"an instance needs {need / MIB:.0f} MiB and a {NODE_GIB} GiB node gives {node / MIB:.0f} MiB (the head"
            f" {head / MIB:.0f} MiB): the setting must fit exactly one per worker node and none on the head"
        )
    spec = catalog[MODELS[0]]
    return {
        "weight_bytes": spec.weight_bytes,
        "kv_reserved_bytes": spec.kv_reserved_bytes,
        "overhead_bytes": need - spec.weight_bytes - spec.kv_reserved_bytes,
        "instance_bytes": need,
        "node_room_bytes": node,
        "head_room_bytes": head,
    }


def node_args(name: str, budget_gib: float, cpus: int) -> dict:
    """cluster_utils node arguments: Orchard's node name and memory budget as labels, a small object store."""
    return {"num_cpus": cpus, "labels": {"orchard.node": name, "orchard.budget_gib": str(budget_gib)}, "object_store_memory": 80 * MIB}


@dataclass
class Outcome:
    model: str
    client: int
    started_s: float  # since the load began
    status: str  # "200", or the failure's code (model_gave_up, ...), or "client:<exception>"
    ttft_s: float | None
    total_s: float
    tokens: int


async def one(session: aiohttp.ClientSession, url: str, model: str, client: int, max_tokens: int, t0: float) -> Outcome:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": NEVER_END,
    }
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    status = "200"
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = await response.text()
                try:
                    status = str(json.loads(text)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    status = str(response.status)
            else:
                chunks = Chunks(response.content)
                async for chunk in chunks:
                    if "error" in chunk:
                        status = f"stream:{chunk['error'].get('code')}"
                        break
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.monotonic() - started
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                if status == "200" and not chunks.done:
                    status = "stream:no_done"
    except (TimeoutError, aiohttp.ClientError) as e:
        status = f"client:{type(e).__name__}"
    return Outcome(
        model, client, round(started - t0, 3), status, None if first is None else round(first, 4), round(time.monotonic() - started, 4), tokens
    )


async def load(base: str, clients: int, seconds: float, max_tokens: int) -> tuple[list[Outcome], list[dict], float, float]:
    """The closed-loop clients and the events poller: (outcomes, events, when the load began on
    time.monotonic's clock, the events' clock too on this one machine, and its wall seconds)."""
    outcomes: list[Outcome] = []
    events: dict[int, dict] = {}
    t0 = time.monotonic()
    stop_at = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout, headers={"Authorization": "Bearer unused"}) as session:

        async def client(i: int) -> None:
            model = MODELS[i % len(MODELS)]
            while time.monotonic() < stop_at:
                outcomes.append(await one(session, f"{base}/v1/completions", model, i, max_tokens, t0))

        async def read_events() -> None:
            since = max(events, default=0)
            async with session.get(f"{base}/v1/cluster/events", params={"since": since}) as r:
                for e in (await r.json())["data"]:
                    events[e["seq"]] = e

        async def poll() -> None:
            while True:
                try:
                    await read_events()
                except (TimeoutError, aiohttp.ClientError) as e:
                    print(f"events: {type(e).__name__}: {e}", flush=True)
                await asyncio.sleep(2.0)

        poller = asyncio.create_task(poll())
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.monotonic() - t0
        poller.cancel()
        await read_events()
    return outcomes, [events[s] for s in sorted(events)], t0, wall


def wait_ready(base: str, timeout_s: float = 120.0) -> None:
    """Until both worker nodes have reported their memory to the residency service."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = requests.get(f"{base}/v1/cluster", timeout=30).json()["nodes"]
        if {n["node_id"] for n in nodes if n["alive"] and n["memory"]["usable_bytes"] > 0} >= set(WORKERS):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the worker nodes did not report within {timeout_s} s")


def run_variant(name: str, policy: dict, models_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", HEAD_GIB, 4) | {"include_dashboard": False})
    session_dir = str(Path(os.environ["RAY_TMPDIR"], "ray", "session_latest").resolve())
    try:
        for worker in WORKERS:
            cluster.add_node(**node_args(worker, NODE_GIB, 2))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"models_dir": str(models_dir), "models": registry(), "policy": policy}), name="orchard", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        print(f"{name}: {a.clients} clients for {a.seconds:.0f} s on {base}, logs in {session_dir}/logs", flush=True)
        outcomes, events, t0, wall = asyncio.run(load(base, a.clients, a.seconds, a.max_tokens))
    finally:
        try:
            serve.shutdown()
        except RuntimeError:  # a handle made in an event loop that has closed since: the cluster goes anyway
            pass
        ray.shutdown()
        cluster.shutdown()
    raw = Path(session_dir) / "contention-raw.json"  # every request and event, too large for bench/results
    raw.write_text(json.dumps({"t0": t0, "outcomes": [asdict(o) for o in outcomes], "events": events}))
    return summarize(policy, outcomes, events, t0, wall) | {"session_dir": session_dir, "raw": str(raw)}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(policy: dict, outcomes: list[Outcome], events: list[dict], t0: float, wall: float) -> dict[str, Any]:
    served_all = sum(o.status == "200" for o in outcomes)
    even = served_all / len(MODELS)
    per_model: dict[str, dict[str, Any]] = {}
    shares: list[float] = []
    for m in MODELS:
        mine = [o for o in outcomes if o.model == m]
        ok = [o for o in mine if o.status == "200"]
        codes: dict[str, int] = {}
        for o in mine:
            if o.status != "200":
                codes[o.status] = codes.get(o.status, 0) + 1
        shares.append(round(len(ok) / even, 3) if even else 0.0)
        per_model[m] = {
            "requests": len(mine),
            "served": len(ok),
            "gave_up": sum(o.status in GAVE_UP for o in mine),
            "other_failures": sum(o.status not in GAVE_UP and o.status != "200" for o in mine),
            "codes": codes,
            "share": shares[-1],
            "ttft_p50_s": pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.50),
            "ttft_p95_s": pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.95),
            "total_p50_s": pct([o.total_s for o in ok], 0.50),
            # requests served per 10 s of the load, by when they ended: where a model starved, and for how long
            "served_per_10s": [sum(1 for o in ok if 10 * k <= o.started_s + o.total_s < 10 * (k + 1)) for k in range(int(wall // 10) + 1)],
        }
    counts = {k: sum(e["kind"] == k for e in events) for k in EVENT_KINDS}
    ok_all = [o for o in outcomes if o.status == "200"]
    totals = {
        "requests": len(outcomes),
        "served": served_all,
        "gave_up": sum(o.status in GAVE_UP for o in outcomes),
        "other_failures": sum(o.status not in GAVE_UP and o.status != "200" for o in outcomes),
        "served_fraction": round(served_all / len(outcomes), 4) if outcomes else 0.0,
        "min_share": min(shares),
        "ttft_p50_s": pct([o.ttft_s for o in ok_all if o.ttft_s is not None], 0.50),
        "ttft_p95_s": pct([o.ttft_s for o in ok_all if o.ttft_s is not None], 0.95),
        "served_per_s": round(served_all / wall, 2),
        "tokens_per_s": round(sum(o.tokens for o in ok_all) / wall, 1),
        "wall_s": round(wall, 1),
    }
    return {
        "policy": policy,
        "models": per_model,
        "totals": totals,
        "event_counts": counts,
        # what was resident when: every load, drain, eviction and cancelled drain, seconds into the load
        "residency": [
            {"s": round(e["at"] - t0, 1), "kind": e["kind"], "model": e["model"], "node_id": e["node_id"], "reason": e["reason"]}
            for e in events
            if e["kind"] in ("loaded", "draining", "evicted", "cancelled")
        ],
    }


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: dict) -> str:
    s = results["sizes"]
    lines = [
        f"\n### Three models on room for two: {results['clients']} streaming clients for {results['seconds']:.0f} s,"
        f" {results['max_tokens']} tokens a request\n",
        f"Each instance reserves {s['instance_bytes'] / MIB:.0f} MiB ({s['weight_bytes'] / MIB:.0f} weights +"
        f" {s['kv_reserved_bytes'] / MIB:.0f} KV + {s['overhead_bytes'] / MIB:.0f} overhead); a {NODE_GIB:g} GiB node gives"
        f" {s['node_room_bytes'] / MIB:.0f} MiB, the head {s['head_room_bytes'] / MIB:.0f} MiB.\n",
        "| variant | model | requests | served | gave up | other failures | share of an even split | TTFT p50 s | TTFT p95 s | total p50 s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in results["variants"].items():
        for m, r in v["models"].items():
            lines.append(
                f"| {name} | {m} | {r['requests']} | {r['served']} | {r['gave_up']} | {r['other_failures']} | {r['share']:.2f}x |"
                f" {_f(r['ttft_p50_s'])} | {_f(r['ttft_p95_s'])} | {_f(r['total_p50_s'])} |"
            )
        t = v["totals"]
        lines.append(
            f"| {name} | **all** | {t['requests']} | {t['served']} ({t['served_fraction']:.1%}) | {t['gave_up']} | {t['other_failures']} |"
            f" min {t['min_share']:.2f}x | {_f(t['ttft_p50_s'])} | {_f(t['ttft_p95_s'])} | |"
        )
    lines += ["", "| variant | " + " | ".join(EVENT_KINDS) + " | served/s | tokens/s |", "|---|" + "---:|" * (len(EVENT_KINDS) + 2)]
    for name, v in results["variants"].items():
        c = v["event_counts"]
        lines.append(
            f"| {name} | " + " | ".join(str(c[k]) for k in EVENT_KINDS) + f" | {v['totals']['served_per_s']} | {v['totals']['tokens_per_s']} |"
        )
    for name, v in results["variants"].items():
        codes = {c: n for r in v["models"].values() for c, n in r["codes"].items()}
        if codes:
            lines.append(f"\n{name}: failures by code {codes}")
        lines.append(f"{name}: served per 10 s " + "; ".join(f"{m} {r['served_per_10s']}" for m, r in v["models"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--json", default="bench/results/contention.json")
    parser.add_argument("--markdown", default=None)
    a = parser.parse_args(argv)
    chosen = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        parser.error(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    if a.clients < len(MODELS) or a.seconds <= 0 or a.max_tokens < 1:
        parser.error(f"need --clients >= {len(MODELS)}, --seconds > 0 and --max-tokens >= 1")
    models_dir = Path("models").resolve()
    prepare(models_dir, only={"llama-10m"}, log=lambda *_: None)
    # Ray's files (each variant's session and its logs) under a folder of this benchmark's, short
    # enough for Ray's socket paths, kept after the run
    os.environ["RAY_TMPDIR"] = os.environ.get("ORCHARD_CONTENTION_TMPDIR", "/tmp/orchard-contention")
    Path(os.environ["RAY_TMPDIR"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    policies = {name: BASE_POLICY | VARIANTS[name] for name in chosen}
    size = sizes(models_dir, policies[chosen[0]])
    print(
        f"sizes: an instance reserves {size['instance_bytes'] / MIB:.0f} MiB ({size['weight_bytes'] / MIB:.0f} weights + "
        f"{size['kv_reserved_bytes'] / MIB:.0f} KV + {size['overhead_bytes'] / MIB:.0f} overhead); a {NODE_GIB:g} GiB node gives "
        f"{size['node_room_bytes'] / MIB:.0f} MiB (one fits, two need {2 * size['instance_bytes'] / MIB:.0f}), the head "
        f"({HEAD_GIB:g} GiB) {size['head_room_bytes'] / MIB:.0f} MiB",
        flush=True,
    )
    results: dict[str, Any] = {"clients": a.clients, "seconds": a.seconds, "max_tokens": a.max_tokens, "sizes": size, "variants": {}}
    for name in chosen:
        results["variants"][name] = run_variant(name, policies[name], models_dir, a)
    results["machine"] = {"python": platform.python_version(), "processor": platform.machine(), "cpus": os.cpu_count()}
    publish(results, table(results), a.json, a.markdown)
    last = results["variants"].get("swaps") or results["variants"][chosen[-1]]
    print(f"served {last['totals']['served_fraction']:.4f} min-share {last['totals']['min_share']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
