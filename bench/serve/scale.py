"""`python -m bench.serve.scale`: short requests with an ingress on every node (issue 11, goal 3).

For each cluster size N: a local Ray cluster of N nodes on this machine (cluster_utils), Orchard
with `ingress_replicas: every_node` and Serve's direct ingress (each node's ingress replica on a
port of its own, as `make run` serves), one copy of the model loaded on every node, then one client
process per node, each running closed-loop clients against its own node's ingress address for the
same seconds. The aggregate rate should grow with N while the machine has cores to spare (the H200
machine has 16: measure there; on a 2-core VM every node's proxy and ingress share two cores with
the clients and the engines). Prints a table, writes JSON (default bench/results/scale.json)."""

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from bench.report import write_json
from cluster.environment import SERVE_ENV, session_token_env  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs

for _k, _v in SERVE_ENV.items():  # the product's Serve mode
    os.environ.setdefault(_k, _v)

ROOT = Path(__file__).resolve().parents[2]


def _client_process(base: str, route: str, body: dict, clients: int, seconds: float, warmup_s: float, start_at: float, out: Any) -> None:
    """One node's client: `clients` closed-loop clients for `warmup_s` untimed (a GPU compiles its
    kernels per batch shape: 3 lone requests do not warm a batch of 8), then from `start_at`
    (time.time()) for `seconds`; puts (requests done, errors, latencies in ms) on `out`."""
    import aiohttp

    async def main() -> tuple[int, int, list[float]]:
        done, errors, latencies = 0, 0, []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:

            async def closed_loop(k: int, stop: float, timed: bool) -> None:
                nonlocal done, errors
                n = 0
                while time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    async with session.post(f"{base}/v1/{route}", json=_body(body, k * 1_000_000 + n if timed else -10 - k * 1_000_000 - n)) as r:
                        await r.read()
                        ok = r.status == 200
                    n += 1
                    if not timed:
                        continue
                    if ok:
                        done += 1
                        latencies.append(1000 * (time.perf_counter() - t0))
                    else:
                        errors += 1

            for i in range(3):  # warm this node's path
                async with session.post(f"{base}/v1/{route}", json=_body(body, -1 - i)) as r:
                    await r.read()
            if warmup_s > 0:
                warm_stop = time.perf_counter() + min(warmup_s, max(0.0, start_at - time.time() - 0.5))
                await asyncio.gather(*(closed_loop(k, warm_stop, False) for k in range(clients)))
            await asyncio.sleep(max(0.0, start_at - time.time()))
            stop = time.perf_counter() + seconds
            await asyncio.gather(*(closed_loop(k, stop, True) for k in range(clients)))
        return done, errors, latencies

    out.put(asyncio.run(main()))


def _body(template: dict, i: int) -> dict:
    """A distinct text per request (no server may answer from an exact-repeat cache)."""
    body = dict(template)
    if "input" in body:
        body["input"] = f"{body['input']} {i}"
    else:
        body["messages"] = [{"role": "user", "content": f"Hi {i}"}]
    return body


def run_size(n: int, models_dir: Path, model: str, kind: str, clients: int, seconds: float, cpus: int, warmup_s: float = 0.0) -> dict[str, Any]:
    import ray
    import requests
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.ports import free_port
    from router.api.builder import build_app
    from router.residency.registry import from_manifest

    names = ["head"] + [f"node-{i}" for i in range(1, n)]
    port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": cpus,
            "labels": {"orchard.node": "head", "orchard.budget_gib": "16"},
            "include_dashboard": False,
            "object_store_memory": 80 << 20,
        },
    )
    for name in names[1:]:
        cluster.add_node(
            num_cpus=cpus,
            labels={"orchard.node": name, "orchard.budget_gib": "16"},
            object_store_memory=80 << 20,
        )
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="EveryNode")
        registry = [m for m in from_manifest(models_dir, {model: {"max_copies": n}}) if m["name"] == model]
        policy = {"safety_margin_bytes": 0, "safety_margin_fraction": 0, "min_residency_s": 0, "residency_per_reload": 0}
        app = {"models_dir": str(models_dir), "models": registry, "policy": policy, "ingress_replicas": "every_node"}
        serve.run(build_app(app), name="orchard", route_prefix="/")
        head = f"http://127.0.0.1:{port}"
        for name in names:  # one copy on every node
            r = requests.post(f"{head}/v1/models/{model}/load", json={"node": name}, timeout=300)
            r.raise_for_status()
        urls: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(urls) < n and time.monotonic() < deadline:  # each replica's own server starts once it is ready
            urls = {e["node_id"]: e["url"] for e in requests.get(f"{head}/v1/cluster", timeout=30).json()["ingress"]}
            time.sleep(0.5)
        body: dict[str, Any]
        if kind == "embeddings":
            route, body = "embeddings", {"model": model, "input": "one short string, number"}
        else:
            route, body = "chat/completions", {"model": model, "max_tokens": 1, "temperature": 0}
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 5.0 + warmup_s
        procs = [ctx.Process(target=_client_process, args=(urls[name], route, body, clients, seconds, warmup_s, start_at, out)) for name in names]
        for p in procs:
            p.start()
        got = [out.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        done = sum(g[0] for g in got)
        latencies = [x for g in got for x in g[2]]
        routing = requests.get(f"{head}/v1/cluster", timeout=30).json()["routing"]
        return {
            "nodes": n,
            "clients": clients * n,
            "req_s": done / seconds,
            "per_node_req_s": [g[0] / seconds for g in got],
            "errors": sum(g[1] for g in got),
            "p50_ms": statistics.median(latencies) if latencies else None,
            "leases_granted": routing["leases_granted"],
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--kind", choices=["embeddings", "chat"], default="embeddings")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients per node")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--cpus-per-node", type=int, default=2)
    ap.add_argument(
        "--warmup-seconds", type=float, default=0.0, help="each node's clients run untimed first (2 on a GPU: kernels compile per batch shape)"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    a = ap.parse_args(argv)
    from deployments.models import prepare

    prepare(a.models_dir, {a.model}, log=lambda *_: None)
    rows = []
    for n in a.nodes:
        print(f"{n} node(s)", flush=True)
        row = run_size(n, a.models_dir.resolve(), a.model, a.kind, a.clients, a.seconds, a.cpus_per_node, a.warmup_seconds)
        rows.append(row)
        print(
            f"  {row['req_s']:.1f} req/s aggregate, per node {[round(x, 1) for x in row['per_node_req_s']]}, p50 {row['p50_ms']:.1f} ms, errors {row['errors']}",
            flush=True,
        )
    base = rows[0]["req_s"] / rows[0]["nodes"] if rows else 0.0
    lines = [
        "| nodes | clients | req/s (all nodes) | per node | / first size, per node | p50 ms | errors | leases granted |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        per = ", ".join(f"{x:.1f}" for x in r["per_node_req_s"])
        lines.append(
            f"| {r['nodes']} | {r['clients']} | {r['req_s']:.1f} | {per} | {r['req_s'] / r['nodes'] / base:.2f} | {r['p50_ms']:.1f} | {r['errors']} | {r['leases_granted']} |"
        )
    print("\n".join(lines))
    result = {
        "model": a.model,
        "kind": a.kind,
        "clients_per_node": a.clients,
        "seconds": a.seconds,
        "rows": rows,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cores": os.cpu_count()},
    }
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
