"""`python -m bench.swap` (make bench-swap): Orchard's main job, more models than fit with requests
for all of them, against vllm-mlx's multi-model registry on the same budget, in one run. Prints a
table, writes JSON (bench/results/swap.json), and a Markdown page with --markdown.

The models: one prepared model (`--model`: the embedded llama-10m by default) registered N times
(m1..mN, `--models`), each declaring `--weight-gib` of weights, so that the servers' own arithmetic
decides what fits: room for K (`--room`) at a time. For llama-10m the declared size (1 GiB by
default) stands in for a real model's, not its real 36 MiB; for any other model (`--model
llama-1b-shape` on a GPU: Llama-3.2-1B's shape, random bf16 weights, built by deployments.models
prepare) the default is its real safetensors size, so the room for K is real memory.

- Orchard: a local Ray cluster started by this process (ray.cluster_utils, Ray's token auth, the
  product's Serve mode), ONE node (a single Mac) whose store is the prepared models/ folder and whose
  memory budget holds exactly K instances as the policy counts them (weights + KV reservation +
  per-instance overhead, against what the node gives after its safety margin: computed with
  policy.memory and checked before anything starts). Policy: `contention: wait`,
  `wait_timeout_s: 60`, a small safety margin (64 MiB, no fraction); the rest at Orchard's defaults,
  so a change of defaults shows here. Clients use the ingress replica's own URL (Serve's direct
  ingress, as README's URL is).
- vllm-mlx 0.6.0 (its own site folder, mlx-lm 0.31.3, as bench.peers runs it): `serve
  --models-config <yaml> --continuous-batching`, the same N names on the model's folder, each
  `estimated_memory_gb` the same declared weights, `memory_budget_gb` K x that (it counts weights
  only: K fit), contention strategy `wait` with a generous timeout.

The trace (seeded, the same for both): `--requests` streamed chat completions (greedy,
`--max-tokens`, a short prompt; tokens counted from the stream's usage) arriving open-loop over
`--seconds` (Poisson), the model drawn with Zipf(`--zipf`) popularity (m1 the most popular), plus a
burst of `--burst` requests for the least popular model at 40% of the run, all at once. At most
`--clients` requests in flight; a request waiting for a slot counts its time from its scheduled
arrival, so queueing shows. Loads: Orchard's `loaded` events (GET /v1/cluster/events) during the
trace; vllm-mlx's "BatchedEngine loaded" log lines (its registry logs each load so), with its
/v1/status polled for the timeline of which model was loaded when.

Before the trace, each server starts with nothing loaded and serves one request for m1 (the
"cold first token": room free, weights stored, nothing loaded), against the in-process cost of the
same in this process: mlx_lm.load of the folder and one greedy token."""

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
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
import yaml  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import deployments  # noqa: E402, F401  (OpenBLAS before MLX, as the model servers)
from bench.peers.__main__ import Peer  # noqa: E402
from bench.report import publish  # noqa: E402
from bench.swap.trace import Outcome, Request, build, replay, summarize  # noqa: E402
from cluster.store import ENV_STORE  # noqa: E402
from deployments.models import prepare  # noqa: E402
from policy.cluster_state import NodeState  # noqa: E402
from policy.config import GIB, MIB, PolicyConfig  # noqa: E402
from policy.memory import ever_available_bytes, required_bytes  # noqa: E402
from router.api.builder import build_app  # noqa: E402
from router.residency.registry import from_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-10m"  # the default --model
DECLARED_GIB = 1.0  # what each name declares for llama-10m (--weight-gib's default for it)
NODE = "mac-1"
POLICY: dict[str, Any] = {
    "contention": "wait",
    "wait_timeout_s": 60,
    "safety_margin_bytes": "64MiB",  # the default 512 MiB + 2% would be most of a small budget
    "safety_margin_fraction": 0,
}
# Orchard as shipped, and variants a run may add to --servers to see what a setting buys (policy overrides)
ORCHARDS: dict[str, dict[str, Any]] = {
    "orchard": {},
    "orchard-no-spares": {"spares_per_node": 0},  # every load starts its process (rule R1 off)
    "orchard-fixed-e3": {"residency_per_reload": 0, "min_residency_s": 10},  # a fixed 10 s minimum residency (E3 before)
}
VLLM_WAIT_S = 600  # vllm-mlx's wait for room: generous, no request of the trace should give up on it
BURST_AT = 0.4
TIMELINE_KINDS = ("waiting", "draining", "evicted", "released", "stopped", "unloaded", "loading", "loaded", "cancelled", "gave_up", "rejected")
VLLM_LOADED = "BatchedEngine loaded:"  # vllm_mlx/engine/batched.py, logged once per engine start
VLLM_STOPPED = "BatchedEngine stopped"


def names(n: int) -> list[str]:
    return [f"m{i}" for i in range(1, n + 1)]


def registry(models: list[str], weight_gib: float, model: str = MODEL, models_dir: Path = ROOT / "models") -> list[dict]:
    """Orchard's registry entries: each name declares `weight_gib`. Orchard's engine measures what a
    model really holds after its load and reserves that from then on (M1), so a name standing in
    for more than its real weights (llama-10m's 36 MiB for 1 GiB) holds the difference as instance
    overhead, which no measurement replaces: the declared size stands for the whole run."""
    declared = int(weight_gib * GIB)
    extra = declared - weights_bytes(models_dir / model)
    if extra <= 16 * MIB:  # the real weights (a GPU model): declared as they are
        return [{"name": m, "kind": "llm", "path": model, "weight_bytes": declared} for m in models]
    overhead = PolicyConfig.model_validate(POLICY).instance_overhead_bytes + extra
    return [{"name": m, "kind": "llm", "path": model, "overhead_bytes": overhead} for m in models]


def weights_bytes(folder: Path) -> int:
    """The model's real weights: its safetensors files."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def weights_gib(folder: Path) -> float:
    """The model's real weights, in GiB."""
    return weights_bytes(folder) / GIB


def sizes(models_dir: Path, models: list[str], weight_gib: float, room: int, model: str = MODEL) -> dict[str, Any]:
    """What one instance reserves, by the policy's arithmetic, and a node budget that holds exactly
    `room` of them (halfway between room and room + 1, so rounding cannot tip it); a ValueError
    unless the policy agrees."""
    catalog, _ = from_config(registry(models, weight_gib, model, models_dir), models_dir)
    config = PolicyConfig.model_validate(POLICY)
    spec = catalog[models[0]]
    need = required_bytes(spec, config)

    def gives(gib: float) -> int:
        budget = int(gib * GIB)
        return ever_available_bytes(NodeState(node_id="n", total_bytes=budget, usable_bytes=budget), config)

    margin = GIB - gives(1.0)  # what a node keeps free (the fixed margin: POLICY has no fraction)
    budget_gib = round(((room + 0.5) * need + margin) / GIB, 3)
    node = gives(budget_gib)
    if not room * need <= node < (room + 1) * need:
        raise ValueError(f"a {budget_gib} GiB node gives {node / MIB:.0f} MiB: not room for exactly {room} instances of {need / MIB:.0f} MiB")
    return {
        "weight_bytes": spec.weight_bytes,
        "kv_reserved_bytes": spec.kv_reserved_bytes,
        "overhead_bytes": need - spec.weight_bytes - spec.kv_reserved_bytes,
        "instance_bytes": need,
        "node_budget_gib": budget_gib,
        "node_room_bytes": node,
        "fits": node // need,
    }


# ---- the cold first token in this process ------------------------------------------------------------
def in_process_cold(path: Path, prompt: str, repeats: int = 3) -> dict[str, Any]:
    """mlx_lm.load of the folder, then one greedy token of the chat prompt (the time to the first
    token after a fresh load: what a cold request needs of the engine itself); medians of `repeats`."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate

    loads, tokens = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        model, tokenizer = mlx_lm.load(str(path))[:2]
        mx.eval(model.parameters())
        loaded = time.perf_counter()
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        next(iter(stream_generate(model, tokenizer, text, max_tokens=1)))  # the default sampler: argmax
        done = time.perf_counter()
        loads.append(loaded - started)
        tokens.append(done - loaded)
        del model, tokenizer
        mx.clear_cache()
    load_s, token_s = statistics.median(loads), statistics.median(tokens)
    return {"load_s": round(load_s, 3), "first_token_s": round(token_s, 4), "total_s": round(load_s + token_s, 3), "repeats": repeats}


def cold_request(base: str, model: str, prompt: str) -> tuple[Outcome, float]:
    """One streamed request: its outcome, and when it was sent (time.monotonic)."""
    (outcome,), sent, _ = asyncio.run(replay(base, [Request(0, model, 0.0, False, prompt)], 1, 8))
    return outcome, sent


# ---- Orchard ---------------------------------------------------------------------------------------------
def start_orchard(
    models_dir: Path, models: list[str], weight_gib: float, budget_gib: float, policy: dict[str, Any], model: str = MODEL
) -> tuple[Cluster, str, str]:
    """One node, `budget_gib`, its store the prepared models folder: (the cluster, the ingress
    replica's own URL, Ray's session folder)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "labels": {"orchard.node": NODE, "orchard.budget_gib": f"{budget_gib:g}"},
            "include_dashboard": False,
            "object_store_memory": 80 * MIB,
            "env_vars": {ENV_STORE: str(models_dir)},
        },
    )
    session_dir = str(Path(os.environ["RAY_TMPDIR"], "ray", "session_latest").resolve())
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"models_dir": str(models_dir), "models": registry(models, weight_gib, model, models_dir), "policy": policy})
        serve.run(app, name="orchard", route_prefix="/")
        base = direct_ingress(f"http://127.0.0.1:{port}")
        wait_ready(base)
    except BaseException:
        stop_orchard(cluster)
        raise
    return cluster, base, session_dir


def direct_ingress(proxy: str, timeout_s: float = 60.0) -> str:
    """The ingress replica's own HTTP URL (Serve's direct ingress), as GET /v1/cluster lists it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the replica's own server starts after the app is ready
        ingress = requests.get(f"{proxy}/v1/cluster", timeout=30).json().get("ingress") or []
        try:
            if ingress and requests.get(ingress[0]["url"] + "/health", timeout=5).ok:
                return str(ingress[0]["url"])
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the ingress replica's direct HTTP port did not answer (RAY_SERVE_ENABLE_DIRECT_INGRESS=1?)")


def wait_ready(base: str, timeout_s: float = 120.0) -> None:
    """Until the node has reported its memory to the residency service."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = requests.get(f"{base}/v1/cluster", timeout=30).json()["nodes"]
        if any(n["node_id"] == NODE and n["alive"] and n["memory"]["usable_bytes"] > 0 for n in nodes):
            return
        time.sleep(0.5)
    raise RuntimeError(f"node {NODE} did not report within {timeout_s} s")


def stop_orchard(cluster: Cluster) -> None:
    try:
        serve.shutdown()
    except RuntimeError:  # a handle made in an event loop that has closed since: the cluster goes anyway
        pass
    ray.shutdown()
    cluster.shutdown()


def run_orchard(models_dir: Path, trace: list[Request], a: argparse.Namespace, size: dict[str, Any], name: str = "orchard") -> dict[str, Any]:
    models = names(a.models)
    print(f"{name}: starting one node of {size['node_budget_gib']} GiB", flush=True)
    cluster, base, session_dir = start_orchard(models_dir, models, a.weight_gib, size["node_budget_gib"], POLICY | ORCHARDS[name], a.model)
    events: dict[int, dict] = {}

    async def read_events(session: aiohttp.ClientSession) -> None:
        async with session.get(f"{base}/v1/cluster/events", params={"since": max(events, default=0)}) as r:
            for e in (await r.json())["data"]:
                events[e["seq"]] = e

    try:
        stored = requests.get(f"{base}/v1/models/{models[0]}", timeout=30).json().get("orchard", {}).get("stored_on")
        time.sleep(3.0)  # up and idle
        print(f"orchard: up on {base} (logs in {session_dir}/logs; {models[0]} stored on {stored}); the cold request", flush=True)
        cold, cold_sent = cold_request(base, models[0], trace[0].prompt)
        print(f"orchard: cold first token of {models[0]} {cold.first_token_s} s ({cold.error or 'ok'}); the trace", flush=True)
        outcomes, t0, wall = asyncio.run(replay(base, trace, a.clients, a.max_tokens, read_events, poll_every_s=2.0))
    finally:
        stop_orchard(cluster)
    log = [events[s] for s in sorted(events)]
    in_trace = [e for e in log if e["at"] >= t0]
    counts = {k: sum(e["kind"] == k for e in in_trace) for k in TIMELINE_KINDS}
    cold_events = [
        {"s": round(e["at"] - cold_sent, 3), "kind": e["kind"], "model": e["model"], "seconds": e.get("seconds")}
        for e in log
        if cold_sent <= e["at"] < t0 and e["kind"] in ("placed", "fetching", "loading", "loaded")
    ]
    return {
        "url": base,
        "session_dir": session_dir,
        "stored_on": stored,
        "cold": {"first_token_s": cold.first_token_s, "error": cold.error, "events": cold_events},
        "summary": summarize(outcomes, models, wall),
        "loads": counts["loaded"],
        "event_counts": counts,
        "burst": orchard_burst(in_trace, outcomes, t0, models[-1]),
        # every event of the trace, seconds into it
        "events": [
            {"s": round(e["at"] - t0, 3), "kind": e["kind"], "model": e["model"], "seconds": e.get("seconds"), "reason": e["reason"]}
            for e in in_trace
        ],
        "outcomes": [o.__dict__ for o in outcomes],
    }


def orchard_burst(events: list[dict], outcomes: list[Outcome], t0: float, model: str) -> dict[str, Any]:
    """Where the burst's first tokens went: the residency events from the burst's arrival until its
    last first token, seconds after the arrival, and the marks of its model's swap in."""
    burst = [o for o in outcomes if o.burst]
    if not burst:
        return {}
    arrival = t0 + burst[0].at_s
    firsts = [o.first_token_s for o in burst if o.first_token_s is not None]
    end = arrival + max(firsts, default=max(o.total_s for o in burst)) + 0.5
    window = [e for e in events if arrival - 0.5 <= e["at"] <= end and e["kind"] in TIMELINE_KINDS]
    timeline = [
        {"s": round(e["at"] - arrival, 3), "kind": e["kind"], "model": e["model"], "seconds": e.get("seconds"), "reason": e["reason"][:160]}
        for e in window
    ]

    def at(e: dict | None) -> float | None:
        return None if e is None else round(e["at"] - arrival, 3)

    def find(kind: str, of: str | None, after: float) -> dict | None:
        return next((e for e in window if e["kind"] == kind and (of is None or e["model"] == of) and e["at"] >= after), None)

    # the room it got: an idle instance evicted "to place" it, or a busy one drained "for" it
    evict = next(
        (e for e in window if e["kind"] == "evicted" and (f"to place {model}" in e["reason"] or f"drained for {model}" in e["reason"])), None
    )
    victim = evict["model"] if evict else None
    drain = next((e for e in reversed(window) if evict and e["kind"] == "draining" and e["model"] == victim and e["at"] <= evict["at"]), None)
    before = [e for e in events if e["at"] < arrival and e["model"] == model and e["kind"] in ("loaded", "evicted", "unloaded", "died", "stopped")]
    marks = {
        "resident_at_arrival": bool(before) and before[-1]["kind"] == "loaded",
        "waiting": at(find("waiting", model, arrival - 0.5)),
        "victim": victim,
        "victim_drained": drain is not None,
        "draining": at(drain),
        "evicted": at(evict),
        "released": at(find("released", victim, evict["at"])) if evict else None,
        "stopped": at(find("stopped", victim, evict["at"])) if evict else None,
        "loading": at(find("loading", model, arrival - 0.5)),
        "loaded": at(find("loaded", model, arrival - 0.5)),
        "load_s": (find("loaded", model, arrival - 0.5) or {}).get("seconds"),
        "first_token_min": min(firsts, default=None),
        "first_token_p50": statistics.median(firsts) if firsts else None,
    }
    return {"model": model, "arrival_s": burst[0].at_s, "marks": marks, "timeline": timeline}


# ---- vllm-mlx --------------------------------------------------------------------------------------------
def vllm_config(path: Path, models: list[str], weight_gib: float, room: int) -> dict[str, Any]:
    """vllm_mlx/model_registry.py's YAML: manager.memory_budget_gb (weights only), its contention
    policy, and one entry per name, each with the declared weights as estimated_memory_gb."""
    return {
        "manager": {
            "memory_budget_gb": room * weight_gib,
            "contention_policy": {"strategy": "wait", "wait_timeout_s": VLLM_WAIT_S},
        },
        "models": [{"name": m, "path": str(path), "estimated_memory_gb": weight_gib} for m in models],
    }


def run_vllm(path: Path, trace: list[Request], a: argparse.Namespace) -> dict[str, Any]:
    models = names(a.models)
    with tempfile.TemporaryDirectory(prefix="orchard-swap-vllm-") as home:
        config = Path(home) / "models.yaml"
        config.write_text(yaml.safe_dump(vllm_config(path, models, a.weight_gib, a.room), sort_keys=False))
        peer = Peer(
            "vllm-mlx",
            [sys.executable, "-m", "vllm_mlx.cli", "serve", "--models-config", str(config), "--continuous-batching"],
            models[0],
            # its own mlx-lm first; an empty HOME, as it writes a prefix cache there when it stops
            env={"PYTHONPATH": os.pathsep.join([str(a.vllm_mlx_site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "HOME": home},
        )
        peer.log = Path(tempfile.gettempdir()) / "orchard-swap-vllm-mlx.log"
        print(f"vllm-mlx: starting (log {peer.log})", flush=True)
        base = peer.start(free_port())
        timeline: list[dict[str, Any]] = []
        last: dict[str, str] = {}

        async def read_status(session: aiohttp.ClientSession) -> None:
            async with session.get(f"{base}/v1/status") as r:
                body = await r.json()
            now = time.monotonic()
            for m in body["model_manager"]["models"]:
                if last.get(m["id"]) != m["status"]:
                    last[m["id"]] = m["status"]
                    timeline.append({"at": now, "model": m["id"], "status": m["status"]})

        try:
            listed = requests.get(f"{base}/v1/models", timeout=30).json()
            time.sleep(3.0)
            print(f"vllm-mlx: up on {base} ({', '.join(x['id'] for x in listed['data'])}); the cold request", flush=True)
            cold, _ = cold_request(base, models[0], trace[0].prompt)
            print(f"vllm-mlx: cold first token of {models[0]} {cold.first_token_s} s ({cold.error or 'ok'}); the trace", flush=True)
            offset = peer.log.stat().st_size
            outcomes, t0, wall = asyncio.run(replay(base, trace, a.clients, a.max_tokens, read_status, poll_every_s=0.5))
            time.sleep(0.5)  # its log lines of the last requests
            text = peer.log.read_bytes()[offset:].decode(errors="replace")
        finally:
            peer.stop()
    loads, unloads = text.count(VLLM_LOADED), text.count(VLLM_STOPPED)
    if loads == 0:
        print("vllm-mlx: no load logged during the trace (every model stayed resident?)", flush=True)
    burst = [o for o in outcomes if o.burst]
    arrival = t0 + burst[0].at_s if burst else t0
    return {
        "url": base,
        "config": vllm_config(path, models, a.weight_gib, a.room),
        "log": str(peer.log),
        "cold": {"first_token_s": cold.first_token_s, "error": cold.error},
        "summary": summarize(outcomes, models, wall),
        "loads": loads,
        "unloads": unloads,
        # /v1/status every 0.5 s: each model's status when it changed, seconds into the trace
        "residency": [{"s": round(x["at"] - t0, 2), "model": x["model"], "status": x["status"]} for x in timeline if x["at"] >= t0],
        "burst": {
            "model": models[-1],
            "arrival_s": burst[0].at_s if burst else None,
            # seconds after the burst arrived when a poll first saw its model loaded (a poll every 0.5 s)
            "seen_loaded": next(
                (round(x["at"] - arrival, 2) for x in timeline if x["at"] >= arrival and x["model"] == models[-1] and x["status"] == "loaded"), None
            ),
            "timeline": [
                {"s": round(x["at"] - arrival, 2), "model": x["model"], "status": x["status"]} for x in timeline if arrival - 0.5 <= x["at"]
            ][:40],
        },
        "outcomes": [o.__dict__ for o in outcomes],
    }


# ---- the report ------------------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(r: dict[str, Any]) -> str:
    t, size = r["trace"], r["sizes"]
    lines = [
        f"{t['requests']} requests over {t['seconds']:.0f} s (Poisson, Zipf s={t['zipf']} over {', '.join(t['models'])}: "
        f"{', '.join(f'{m} {n}' for m, n in t['per_model'].items())}) + a burst of {t['burst']} for {t['models'][-1]} at "
        f"{t['burst_at_s']:.0f} s; at most {t['clients']} in flight, {t['max_tokens']} tokens max, seed {t['seed']}. "
        f"Room for {r['room']}: Orchard's node {size['node_budget_gib']} GiB ({size['instance_bytes'] / MIB:.0f} MiB an instance: "
        f"{size['weight_bytes'] / MIB:.0f} weights + {size['kv_reserved_bytes'] / MIB:.0f} KV + {size['overhead_bytes'] / MIB:.0f} overhead), "
        f"vllm-mlx's budget {r['room'] * r['weight_gib']:g} GB of {r['weight_gib']:g} GB weights each.",
        "",
        "| server | tok/s | ok | first token p50 / p95 / p99 s | worst model p95 s | loads | burst model median first token s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, x in r["servers"].items():
        s = x["summary"]
        lines.append(
            f"| {name} | {s['tok_s']:.1f} | {s['ok']}/{s['requests']} | {_s(s['first_token_p50_s'])} / {_s(s['first_token_p95_s'])} /"
            f" {_s(s['first_token_p99_s'])} | {_s(s['worst_model_p95_s'])} ({s['worst_model']}) | {x['loads']} |"
            f" {_s(s['burst_first_token_p50_s'])} ({s['burst_ok']}/{s['burst_requests']} ok) |"
        )
    if r.get("ratios"):
        q = r["ratios"]
        lines += [
            "",
            f"Orchard / vllm-mlx: first token p95 {q['p95']}x, worst model's p95 {q['worst_model_p95']}x, "
            f"burst model's median {q['burst_p50']}x (below 1: Orchard's first tokens come sooner); tok/s {q['tok_s']}x.",
        ]
    for name, x in r["servers"].items():
        if x["summary"]["errors"]:
            lines.append(f"\n{name} failures: " + "; ".join(f"{n} x {e}" for e, n in x["summary"]["errors"].items()))
    c = r.get("cold") or {}
    if c:
        raw = c["in_process"]
        lines += [
            "",
            "Cold first token (room free, weights stored, nothing loaded; one request after the server is up and idle):",
            "",
            f"- in process, mlx_lm.load + one greedy token: {raw['load_s']:.2f} + {raw['first_token_s']:.3f} = {raw['total_s']:.2f} s"
            f" (median of {raw['repeats']})",
        ]
        for name, x in r["servers"].items():
            if x["cold"]["first_token_s"] is None:
                lines.append(f"- {name}: failed ({x['cold']['error']})")
                continue
            extra = ""
            loaded = next((e for e in x["cold"].get("events", []) if e["kind"] == "loaded"), None)
            if loaded:
                extra = f"; its `loaded` event at {loaded['s']:.2f} s says the load took {loaded['seconds']:.2f} s"
            lines.append(
                f"- {name}: {x['cold']['first_token_s']:.2f} s from the client, {x['cold']['first_token_s'] - raw['total_s']:+.2f} s"
                f" against in process{extra}"
            )
    lines += burst_lines(r)
    return "\n".join(lines) + "\n"


def burst_lines(r: dict[str, Any]) -> list[str]:
    """Where the burst model's first tokens went, from Orchard's event log (and vllm-mlx's polled status)."""
    out: list[str] = []
    b = (r["servers"].get("orchard") or {}).get("burst") or {}
    if b.get("marks"):
        m, model = b["marks"], b["model"]
        head = f"Orchard, the burst of {model} at {b['arrival_s']:.0f} s (seconds after it arrived):"
        if m["resident_at_arrival"]:
            out += ["", f"{head} {model} was loaded already; first tokens {_s(m['first_token_min'])} (first) / {_s(m['first_token_p50'])} (median)."]
        else:
            how = f"drained from {_s(m['draining'])}, " if m["victim_drained"] else "idle, "
            out += [
                "",
                f"{head} `waiting` {_s(m['waiting'])}; room from {m['victim'] or '-'} ({how}`evicted` {_s(m['evicted'])}, its memory"
                f" given back (`released`) {_s(m.get('released'))}, its process gone (`stopped`) {_s(m['stopped'])}); {model} `loading`"
                f" {_s(m['loading'])}, `loaded` {_s(m['loaded'])} (the load {_s(m['load_s'])} s); first tokens {_s(m['first_token_min'])}"
                f" (first) / {_s(m['first_token_p50'])} (median).",
            ]

            def gap(x: float | None, y: float | None) -> str:
                return "-" if x is None or y is None else f"{y - x:.2f} s"

            room = m.get("released") if m.get("released") is not None else m["stopped"]  # what the load waited for (X1)
            out += [
                "",
                f"- until room was given (the victim chosen{', drained' if m['victim_drained'] else ''} and evicted): {gap(0.0, m['evicted'])}",
                f"- the victim's engine stopping, its memory given back in its process: {gap(m['evicted'], m.get('released'))}",
                f"- after that, until the load started (a node report showing the room): {gap(room, m['loading'])}",
                f"- the load (a spare process, or a new one, taking the model; the weights loaded and measured): {gap(m['loading'], m['loaded'])}",
                f"- from loaded to the first token: {gap(m['loaded'], m['first_token_min'])}",
                f"- beside those, the victim's process exiting: {gap(m['evicted'], m['stopped'])} after its eviction",
            ]
    v = (r["servers"].get("vllm-mlx") or {}).get("burst") or {}
    if v:
        out += ["", f"vllm-mlx: a poll of /v1/status (every 0.5 s) first saw {v['model']} loaded {_s(v['seen_loaded'])} s after the burst arrived."]
    return out


HEAD = """# Swap benchmark: more models than fit, Orchard against vllm-mlx

Produced by `make bench-swap` (`python -m bench.swap --markdown docs/swap-benchmark.md`); JSON, every
request and the servers' residency timelines in `bench/results/swap.json`. One run on {machine}, {date},
Orchard at {revision}.

The job Orchard is for: more models than fit, with requests for all of them. {n} names (m1..m{n})
for {what}; room for {room} at a time. Orchard: one node (a single Mac) whose
budget holds exactly {room} instances as its policy counts them (weights + KV reservation +
overhead), `contention: wait`, `wait_timeout_s: 60`, a 64 MiB safety margin, the rest at its
defaults; the clients use the ingress replica's own URL. vllm-mlx 0.6.0: `serve --models-config
--continuous-batching`, the same names, `estimated_memory_gb` {weight:g} each and
`memory_budget_gb` {budget:g} (it counts weights only), contention `wait`. The same seeded trace
against each, one after the other: streamed greedy chat completions, open-loop Poisson arrivals,
Zipf popularity, and a burst for the least popular model. First tokens count from each request's
scheduled arrival (a wait for one of the {clients} client slots included). Loads: Orchard's `loaded`
events, vllm-mlx's engine-start log lines, during the trace. On this machine the client and the
server share {cores} cores: ratios say more than seconds.

"""


def machine() -> str:
    import mlx.core as mx

    device = "CPU MLX" if mx.default_device() == mx.cpu else "MLX on the GPU"
    if mx.default_device() != mx.cpu and (card := mx.device_info().get("device_name")):
        device += f" ({card})"
    return f"{os.cpu_count()}-core {platform.system()} {platform.machine()}, {device}"


def declared(model: str, weight_gib: float) -> str:
    """The page's words for what each name is."""
    if model == MODEL:
        return (
            f"the embedded {MODEL}, each declaring {weight_gib:g} GiB of weights so that the servers' own\naccounting decides what fits"
            f" (Orchard's entries hold what {MODEL}'s real weights leave of the {weight_gib:g} GiB as instance\noverhead, which the"
            " measurement its engine makes after a load does not replace)"
        )
    return f"{model}, each declaring its real {weight_gib:.3g} GiB of weights (its safetensors), so that the\nroom the servers' accounting gives is real memory"


def revision() -> str:
    """The commit Orchard ran at, and whether its code (not bench/ nor docs/) differed from it."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "an unknown commit (no git)"
    dirty = git("diff", "--quiet", "HEAD", "--", "cluster", "deployments", "policy", "router").returncode != 0
    return f"commit {head.stdout.strip()}" + (" with uncommitted changes" if dirty else "")


def kept(markdown: str | None) -> str:
    """What a page keeps of itself when a run writes it again: its "## On the GPU" section and what
    follows (runs made on another machine, written by hand)."""
    if not markdown or not Path(markdown).is_file():
        return ""
    text = Path(markdown).read_text()
    at = text.find("\n## On the GPU")
    return "" if at < 0 else text[at:]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="orchard,vllm-mlx", help=f"comma-separated, of {', '.join(ORCHARDS)} and vllm-mlx")
    ap.add_argument("--model", default=MODEL, help="the prepared model every name serves (llama-1b-shape on a GPU)")
    ap.add_argument("--models", type=int, default=4, help="N: how many names (m1..mN) for the model")
    ap.add_argument("--room", type=int, default=2, help="K: how many fit at a time")
    ap.add_argument(
        "--weight-gib",
        type=float,
        default=None,
        help=f"the weights each name declares (default: {DECLARED_GIB:g} for {MODEL}, the model's real safetensors size for any other)",
    )
    ap.add_argument("--requests", type=int, default=60, help="Poisson arrivals over --seconds (the burst comes on top)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--burst", type=int, default=12, help="requests for the least popular model, together at 40%% of the run")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--clients", type=int, default=16, help="the most requests in flight")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--vllm-mlx-site", type=Path, default=ROOT / ".peers" / "vllm-mlx")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "swap.json"))
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    wanted = [s.strip() for s in a.servers.split(",") if s.strip()]
    if not wanted or set(wanted) - {*ORCHARDS, "vllm-mlx"}:
        ap.error(f"--servers: of {', '.join([*ORCHARDS, 'vllm-mlx'])}, not {a.servers!r}")
    if not 1 <= a.room < a.models:
        ap.error("need 1 <= --room < --models: more models than fit")
    models = names(a.models)
    models_dir = a.models_dir.resolve()
    prepare(models_dir, {a.model}, log=lambda *_: None)
    path = (models_dir / a.model).resolve()
    if a.weight_gib is None:
        a.weight_gib = DECLARED_GIB if a.model == MODEL else round(weights_gib(path), 4)
    # Ray's files under a folder of this benchmark's, short enough for Ray's socket paths, kept after the run
    os.environ["RAY_TMPDIR"] = os.environ.get("ORCHARD_SWAP_TMPDIR", "/tmp/orchard-swap")
    Path(os.environ["RAY_TMPDIR"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    size = sizes(models_dir, models, a.weight_gib, a.room, a.model)
    print(
        f"sizes: {a.model}, {a.weight_gib:g} GiB declared a name; an Orchard instance reserves {size['instance_bytes'] / MIB:.0f} MiB ({size['weight_bytes'] / MIB:.0f} weights + "
        f"{size['kv_reserved_bytes'] / MIB:.0f} KV + {size['overhead_bytes'] / MIB:.0f} overhead); the {size['node_budget_gib']} GiB node "
        f"gives {size['node_room_bytes'] / MIB:.0f} MiB: {size['fits']} fit. vllm-mlx: budget {a.room * a.weight_gib:g} GB of weights, "
        f"{a.weight_gib:g} GB each: {a.room} fit",
        flush=True,
    )
    rev = revision()  # before the servers: what they run
    trace = build(models, a.requests, a.seconds, a.burst, BURST_AT, a.zipf, a.seed)
    per_model = {m: sum(r.model == m and not r.burst for r in trace) for m in models}
    print(f"trace: {len(trace)} requests, {per_model} + {a.burst} x {models[-1]} at {BURST_AT * a.seconds:.0f} s", flush=True)
    raw = in_process_cold(path, trace[0].prompt)
    print(f"in process: mlx_lm.load {raw['load_s']} s + one greedy token {raw['first_token_s']} s", flush=True)
    servers: dict[str, Any] = {}
    for name in (w for w in wanted if w in ORCHARDS):
        servers[name] = run_orchard(models_dir, trace, a, size, name)
    if "vllm-mlx" in wanted:
        servers["vllm-mlx"] = run_vllm(path, trace, a)
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "revision": rev,
        "model": a.model,
        "room": a.room,
        "weight_gib": a.weight_gib,
        "sizes": size,
        "policy": POLICY,
        "trace": {
            "models": models,
            "requests": a.requests,
            "seconds": a.seconds,
            "burst": a.burst,
            "burst_at_s": BURST_AT * a.seconds,
            "zipf": a.zipf,
            "clients": a.clients,
            "max_tokens": a.max_tokens,
            "seed": a.seed,
            "per_model": per_model,
        },
        "cold": {"in_process": raw},
        "servers": servers,
    }
    if {"orchard", "vllm-mlx"} <= servers.keys():
        o, v = servers["orchard"]["summary"], servers["vllm-mlx"]["summary"]
        results["ratios"] = {
            "p95": ratio(o["first_token_p95_s"], v["first_token_p95_s"]),
            "worst_model_p95": ratio(o["worst_model_p95_s"], v["worst_model_p95_s"]),
            "burst_p50": ratio(o["burst_first_token_p50_s"], v["burst_first_token_p50_s"]),
            "tok_s": ratio(o["tok_s"], v["tok_s"]),
        }
    text = render(results)
    head = HEAD.format(
        machine=results["machine"],
        date=results["date"],
        revision=results["revision"],
        n=a.models,
        what=declared(a.model, a.weight_gib),
        weight=a.weight_gib,
        room=a.room,
        budget=a.room * a.weight_gib,
        clients=a.clients,
        cores=os.cpu_count(),
    )
    publish(results, text, a.json, a.markdown, page=(head, kept(a.markdown)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
