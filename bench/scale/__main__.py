"""`python -m bench.scale` (make bench-scale): what more nodes buy. For each cluster size N of
`--nodes` (1, 2 and 4 by default), a fresh local Ray cluster of N Orchard nodes on this host, each
with its own memory budget and its own store (with `--gpus`, each node its own GPU through
CUDA_VISIBLE_DEVICES, as several Macs would each have their own), and two workloads through the
nodes' own ingress URLs (`ingress_replicas: every_node`, Serve's direct ingress), clients spread
over them in turn:

- the swap trace (bench.swap's: `--models` names of one prepared model, Zipf popularity, Poisson
  arrivals over `--seconds`, a burst for the least popular model, at most `--clients` in flight),
  each node holding `--room` of those models at a time; the first node's store holds the weights,
  the others fetch them from a node that holds them when a placement needs them (copies counted);
- the agent workload (bench.peers.agent's conversations: a long shared system prompt, turns that
  resend the history) on one model kept on every node (`pinned`, `min_copies` N), its conversations
  spread over the nodes' URLs, on top of the room the swap models have.

Per N: tok/s, first-token p50/p95 and loads of the trace, the weight copies between nodes, the
agent workload's tok/s, and each node's share (the fraction of the run's samples of /v1/cluster,
once a second, in which it served a request) with its samples idle while some request waited for
a model. Ratios to N = 1 are the figures that matter (this host's cores are shared by every node
here; on GPUs each node has its own). Prints a table and writes JSON (bench/results/scale.json).

    python -m bench.scale [--nodes 1,2,4] [--gpus] [--model llama-10m] [--models 8] [--room 2]
        [--requests 80] [--seconds 60] [--burst 12] [--clients 16] [--agent-conversations 8]
        [--json bench/results/scale.json]
"""

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.environment import SERVE_ENV, session_token_env
from cluster.ports import free_port  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs
for _k, _v in SERVE_ENV.items():  # the product's Serve mode (direct ingress)
    os.environ.setdefault(_k, _v)

import aiohttp  # noqa: E402
import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import deployments  # noqa: E402, F401  (OpenBLAS before MLX, as the model servers)
from bench.engine.agent import system_prompt  # noqa: E402
from bench.peers.agent import HTTPChat, Turn, cell  # noqa: E402
from bench.report import publish  # noqa: E402
from bench.swap.__main__ import POLICY, names, registry, sizes, stop_orchard  # noqa: E402
from bench.swap.trace import build, replay, summarize  # noqa: E402
from cluster.store import ENV_STORE  # noqa: E402
from deployments.models import prepare  # noqa: E402
from policy.config import MIB  # noqa: E402
from router.api.builder import build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
AGENT = "agent"


def node_name(i: int) -> str:
    return f"n{i}"


def node_args(i: int, budget_gib: float, store: Path, gpus: bool) -> dict[str, Any]:
    env = {ENV_STORE: str(store)} | ({"CUDA_VISIBLE_DEVICES": str(i)} if gpus else {})
    return {
        "num_cpus": 4,
        "labels": {"orchard.node": node_name(i), "orchard.budget_gib": f"{budget_gib:g}"},
        "object_store_memory": 80 * MIB,
        "env_vars": env,
    }


def app_args(models_dir: Path, a: argparse.Namespace, n: int) -> dict[str, Any]:
    """The swap models, and the agent model on every node (its own room: the budget has one more);
    `models_dir` holds nothing: a node loads from its own store."""
    agent = registry([AGENT], a.weight_gib, a.model)[0] | {"pinned": True, "min_copies": n, "max_copies": n}  # sized as a swap model
    return {
        "models_dir": str(models_dir),
        "models": registry(names(a.models), a.weight_gib, a.model) + [agent],
        "policy": POLICY,
        "ingress_replicas": "every_node",
        "watch_period_s": 1.0,
    }


def start(models_dir: Path, a: argparse.Namespace, n: int, budget_gib: float, stores: Path) -> tuple[Cluster, list[str]]:
    """N nodes, node 0's store holding the model, the others' empty (weights follow placement: a
    node fetches them from a holder), no shared folder: (the cluster, each node's own URL)."""
    store = [stores / node_name(i) for i in range(n)]
    shutil.copytree(models_dir / a.model, store[0] / a.model)
    for s in store[1:]:
        s.mkdir(parents=True)
    head = node_args(0, budget_gib, store[0], a.gpus) | {"include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for i in range(1, n):
            cluster.add_node(**node_args(i, budget_gib, store[i], a.gpus))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args(stores / "nowhere", a, n)), name="orchard", route_prefix="/")
        return cluster, ingress_urls(f"http://127.0.0.1:{port}", n)
    except BaseException:
        stop_orchard(cluster)
        raise


def ingress_urls(proxy: str, n: int, timeout_s: float = 180.0) -> list[str]:
    """Each node's ingress replica's own URL, once all N answer and every node has reported its memory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = requests.get(f"{proxy}/v1/cluster", timeout=30).json()
        urls = [i["url"] for i in view.get("ingress") or []]
        reported = [x for x in view["nodes"] if x["alive"] and x["memory"]["usable_bytes"] > 0]
        try:
            if len(urls) == n and len(reported) == n and all(requests.get(u + "/health", timeout=5).ok for u in urls):
                return sorted(urls)
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{n} ingress replicas and nodes did not come up within {timeout_s} s")


def wait_agent_copies(base: str, n: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = requests.get(f"{base}/v1/cluster", timeout=30).json()["nodes"]
        if sum(any(i["model"] == AGENT and i["status"] == "ready" for i in x["instances"]) for x in nodes) == n:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the agent model was not ready on all {n} nodes within {timeout_s} s")


class Sampler:
    """/v1/cluster once a second: per node, samples in which it had a request in flight (a lease),
    and samples in which it had none, nor a load or drain under way, while a request waited for a
    model (a `waiting` event not yet followed by that model's `loaded`)."""

    def __init__(self, base: str, models: set[str]):
        self.base, self.models = base, models
        self.busy: dict[str, int] = {}
        self.idle_while_waiting: dict[str, int] = {}
        self.samples = 0
        self.waiting: set[str] = set()
        self.events: dict[int, dict] = {}

    async def __call__(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.base}/v1/cluster/events", params={"since": max(self.events, default=0)}) as r:
            for e in (await r.json())["data"]:
                self.events[e["seq"]] = e
                if e["model"] in self.models and e["kind"] == "waiting":
                    self.waiting.add(e["model"])
                elif e["kind"] in ("loaded", "rejected", "gave_up", "cancelled"):
                    self.waiting.discard(e["model"])
        async with session.get(f"{self.base}/v1/cluster") as r:
            nodes = (await r.json())["nodes"]
        self.samples += 1
        for x in nodes:
            leases = sum(i["leases"] for i in x["instances"] if i["model"] in self.models)
            swapping = any(i["status"] != "ready" for i in x["instances"])  # a load or a drain under way: not idle
            self.busy[x["node_id"]] = self.busy.get(x["node_id"], 0) + (leases > 0)
            if leases == 0 and not swapping and self.waiting:
                self.idle_while_waiting[x["node_id"]] = self.idle_while_waiting.get(x["node_id"], 0) + 1

    def shares(self) -> dict[str, dict[str, Any]]:
        total = max(1, sum(self.busy.values()))
        nodes = sorted(set(self.busy) | set(self.idle_while_waiting))
        return {
            x: {
                "share": round(self.busy.get(x, 0) / total, 3),
                "busy_samples": self.busy.get(x, 0),
                "idle_while_waiting": self.idle_while_waiting.get(x, 0),
            }
            for x in nodes
        }


def trace_phase(urls: list[str], a: argparse.Namespace) -> dict[str, Any]:
    models = names(a.models)
    trace = build(models, a.requests, a.seconds, a.burst, 0.4, a.zipf, a.seed)
    sampler = Sampler(urls[0], set(models))
    outcomes, t0, wall = asyncio.run(replay(urls, trace, a.clients, a.max_tokens, sampler, poll_every_s=1.0))
    events = [e for e in sampler.events.values() if e["at"] >= t0]
    # copies of the whole run: the agent model's copies before the trace carry the folder the trace's
    # names share to every node
    fetched = [e for e in sampler.events.values() if e["kind"] == "fetched"]
    return {
        "summary": summarize(outcomes, models, wall),
        "loads": sum(e["kind"] == "loaded" for e in events),
        "loads_by_node": {
            x: sum(e["kind"] == "loaded" and e["node_id"] == x for e in events) for x in sorted({e["node_id"] for e in events if e["node_id"]})
        },
        "copies": len(fetched),
        "copied_bytes": sum(e.get("bytes") or 0 for e in fetched),
        "nodes": sampler.shares(),
    }


class SpreadChat:
    """Each conversation to one node's URL, in turn by its first user message (stable across turns)."""

    def __init__(self, urls: list[str], temperature: float):
        self.chats = [HTTPChat(u, AGENT, temperature) for u in urls]
        self.by_conversation: dict[str, HTTPChat] = {}

    async def __call__(self, messages: list[dict], max_tokens: int) -> Turn:
        key = next(m["content"] for m in messages if m["role"] == "user")
        chat = self.by_conversation.setdefault(key, self.chats[len(self.by_conversation) % len(self.chats)])
        return await chat(messages, max_tokens)

    async def close(self) -> None:
        for c in self.chats:
            await c.close()


def agent_phase(urls: list[str], a: argparse.Namespace, n: int, shared: str) -> dict[str, Any]:
    system = f"Session scale-{n}. {shared}"  # its own first line: no size reuses another's cached prefix
    sampler = Sampler(urls[0], {AGENT})

    async def go() -> dict[str, Any]:
        chat = SpreadChat(urls, a.temperature)
        stop_polling = asyncio.Event()

        async def poll() -> None:
            async with aiohttp.ClientSession() as session:
                while not stop_polling.is_set():
                    await sampler(session)
                    await asyncio.sleep(1.0)

        poller = asyncio.create_task(poll())
        try:
            return await cell(chat, system, a.agent_conversations * n, 1, a.turns, a.tokens)
        finally:
            stop_polling.set()
            await poller
            await chat.close()

    result = asyncio.run(go())
    return {"tok_s": result["tok_s"], "seconds": result["seconds"], "turns": result["turns"], "nodes": sampler.shares()}


def run_size(models_dir: Path, a: argparse.Namespace, n: int, size: dict[str, Any], shared: str) -> dict[str, Any]:
    budget = size["node_budget_gib"]
    print(f"N={n}: {n} node(s) of {budget} GiB", flush=True)
    with tempfile.TemporaryDirectory(prefix="orchard-scale-") as stores:
        cluster, urls = start(models_dir, a, n, budget, Path(stores))
        try:
            wait_agent_copies(urls[0], n)
            print(f"N={n}: up ({', '.join(urls)}); the swap trace", flush=True)
            swap = trace_phase(urls, a)
            print(f"N={n}: trace tok/s {swap['summary']['tok_s']}, p95 {swap['summary']['first_token_p95_s']} s; the agent workload", flush=True)
            agent = agent_phase(urls, a, n, shared)
        finally:
            stop_orchard(cluster)
    return {"nodes": n, "node_budget_gib": budget, "urls": urls, "swap": swap, "agent": agent}


def render(runs: list[dict[str, Any]]) -> str:
    base = runs[0]
    rows = [
        "| nodes | trace tok/s | first token p50 / p95 s | p95 vs 1 node | loads | copies | agent tok/s | agent vs 1 node | busiest / idlest share | idle while waiting |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        s = r["swap"]["summary"]
        p95, p95_1 = s["first_token_p95_s"], base["swap"]["summary"]["first_token_p95_s"]
        shares = [v["share"] for v in r["swap"]["nodes"].values()] or [0.0]
        idle = sum(v["idle_while_waiting"] for v in r["swap"]["nodes"].values())
        rows.append(
            f"| {r['nodes']} | {s['tok_s']} | {s['first_token_p50_s']} / {p95} | "
            f"{round(p95 / p95_1, 2) if p95 and p95_1 else '-'} | {r['swap']['loads']} | {r['swap']['copies']} | "
            f"{r['agent']['tok_s']} | {round(r['agent']['tok_s'] / base['agent']['tok_s'], 2) if base['agent']['tok_s'] else '-'} | "
            f"{max(shares):.2f} / {min(shares):.2f} | {idle} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="1,2,4", help="cluster sizes, comma-separated")
    p.add_argument("--gpus", action="store_true", help="node i gets GPU i (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--model", default="llama-10m")
    p.add_argument("--models", type=int, default=8, help="swap-trace model names")
    p.add_argument("--room", type=int, default=2, help="swap models a node holds at a time")
    p.add_argument("--weight-gib", type=float, default=None, help="declared weights per name (bench.swap's default)")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--burst", type=int, default=12)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--agent-conversations", type=int, default=4, help="concurrent agent conversations per node")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    a = p.parse_args(argv)
    models_dir = ROOT / "models"
    prepare(models_dir, only={a.model})
    if a.weight_gib is None:
        from bench.swap.__main__ import DECLARED_GIB, MODEL, weights_gib

        a.weight_gib = DECLARED_GIB if a.model == MODEL else round(weights_gib(models_dir / a.model), 3)
    size = sizes(models_dir, names(a.models), a.weight_gib, a.room + 1, a.model)  # + the agent model's copy
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(models_dir / a.model)
    shared = system_prompt(lambda text: tokenizer.encode(text), a.system_tokens)
    runs = [run_size(models_dir, a, int(n), size, shared) for n in a.nodes.split(",")]
    table = render(runs)
    report = {
        "benchmark": "scale",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "gpus": a.gpus},
        "command": "python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "size": size,
        "runs": runs,
        "table": table,
    }
    publish(report, table, str(a.json), None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
