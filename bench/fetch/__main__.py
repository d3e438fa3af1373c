"""`python -m bench.fetch` (make bench-fetch): weights moving between node stores on a local 2-node Ray
cluster, against `cp` of the same files on this machine, and what a copy adds to the first token of
a model placed where its weights are not. Prints a table, writes JSON (and Markdown with --markdown).

1. Copy: a folder of --mib MiB (random bytes, in files like a sharded model's) in the head's store is
   copied into mac-1's store by mac-1's node agent (16 MiB chunks from the head's agent through Ray's
   object store, every file's sha256 checked), and with `cp -r` into a plain folder. Each --runs
   times, in turns; the median of each. Both read files the page cache holds (written just before)
   and neither syncs to disk: the comparison is of the paths, not of the SSD.
2. First token: llama-10m, allowed on mac-1 only, asked for through the Serve app: once with its
   weights only in the head's store (copy + load + first token), then unloaded and asked for again
   (load + first token, the copy is stored now)."""

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from cluster.local import session_token_env  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
import requests
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bench.report import publish
from cluster.local import SERVE_ENV
from cluster.node_agent import READ_AHEAD, ensure_agents
from cluster.store import CHUNK_BYTES, ENV_STORE, MANIFEST, PARTIAL, Store
from deployments.models import prepare
from router.api.builder import build_app
from router.residency.registry import from_manifest

MIB = 1024**2
SHARD_MIB = 64


def _node(name: str, budget_gib: float, cpus: int, store: Path) -> dict:
    labels = {"orchard.node": name, "orchard.budget_gib": str(budget_gib)}
    return {"num_cpus": cpus, "labels": labels, "object_store_memory": 200 * MIB, "env_vars": {ENV_STORE: str(store)}}


def make_folder(root: Path, mib: int) -> Path:
    folder = root / "blob"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    left, i = mib, 0
    while left > 0:
        size = min(SHARD_MIB, left)
        with (folder / f"model-{i:05d}.safetensors").open("wb") as f:
            for _ in range(size):
                f.write(os.urandom(MIB))
        left, i = left - size, i + 1
    return folder


@ray.remote(num_cpus=0)
def _transfer_only(source, manifest: dict, depth: int) -> float:
    """MB/s of reading every chunk from `source` with `depth` in flight, writing and hashing nothing:
    what Ray's object transfer between the two nodes gives by itself."""
    started, n = time.perf_counter(), 0
    for f in manifest["files"]:
        refs = []
        for offset in range(0, f["size"], CHUNK_BYTES):
            refs.append(source.read_chunk.remote(manifest["folder"], f["path"], offset))
            if len(refs) >= depth:
                n += len(ray.get(refs.pop(0)))
        n += sum(len(ray.get(r)) for r in refs)
    return n / (time.perf_counter() - started) / 1e6


def copy_runs(stores: dict[str, Path], runs: int) -> dict:
    agents = ensure_agents()
    manifest: dict = cast(dict, ray.get(agents["head"].manifest.remote("blob")))  # sealed here once (hashing is not timed)
    total = sum(f["size"] for f in manifest["files"])
    ray_s: list[float] = []
    cp_s: list[float] = []
    for _ in range(runs):
        Store(stores["mac-1"]).remove("blob")
        started = time.perf_counter()
        result = ray.get(agents["mac-1"].fetch.remote(manifest, ["head"]))
        ray_s.append(time.perf_counter() - started)
        assert result["ok"] and result["bytes"] == total, result
        target = Path(tempfile.mkdtemp(prefix="orchard-cp-"))
        started = time.perf_counter()
        subprocess.run(["cp", "-r", str(stores["head"] / "blob"), str(target / "blob")], check=True)
        cp_s.append(time.perf_counter() - started)
        shutil.rmtree(target)
    copied = stores["mac-1"] / "blob"
    for f in manifest["files"]:  # the last copy, checked once more from outside
        assert hashlib.sha256((copied / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert not (stores["mac-1"] / PARTIAL / "blob").exists() and (copied / MANIFEST).exists()
    ray_mbs, cp_mbs = total / statistics.median(ray_s) / 1e6, total / statistics.median(cp_s) / 1e6
    mac1 = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Labels"].get("orchard.node") == "mac-1")
    on_mac1 = NodeAffinitySchedulingStrategy(node_id=mac1, soft=False)
    transfer = {
        depth: round(ray.get(_transfer_only.options(scheduling_strategy=on_mac1).remote(agents["head"], manifest, depth)), 1)
        for depth in (1, READ_AHEAD, 8)
    }
    return {
        "bytes": total,
        "runs": runs,
        "ray_copy_s": [round(x, 3) for x in ray_s],
        "cp_s": [round(x, 3) for x in cp_s],
        "ray_copy_mb_per_s": round(ray_mbs, 1),
        "cp_mb_per_s": round(cp_mbs, 1),
        "ratio": round(ray_mbs / cp_mbs, 3),
        "transfer_only_mb_per_s_by_read_ahead": transfer,
        "read_ahead": READ_AHEAD,
        "chunk_bytes": CHUNK_BYTES,
    }


def first_token_s(base: str, model: str) -> float:
    body: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
    raise RuntimeError("no token")


def ttft_runs(models_dir: Path, stores: dict[str, Path], port: int) -> dict:
    llama = next(m for m in from_manifest(models_dir, {"llama-10m": {"reserve_context_tokens": 2048}}) if m["name"] == "llama-10m")
    llama = llama | {"policy": llama.get("policy", {}) | {"allowed_nodes": ["mac-1"]}}
    policy = {"min_residency_s": 0, "safety_margin_bytes": 16 * MIB, "safety_margin_fraction": 0, "instance_overhead_bytes": 64 * MIB}
    args = {"models_dir": str(stores["head"].parent / "nowhere"), "models": [llama], "policy": policy, "watch_period_s": 0.5}
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="orchard", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    time.sleep(2)  # a store report from every node
    with_copy = first_token_s(base, "llama-10m")
    events = requests.get(f"{base}/v1/cluster/events", timeout=30).json()["data"]
    fetched = next(e for e in events if e["kind"] == "fetched")
    assert requests.post(f"{base}/v1/models/llama-10m/unload", json={}, timeout=60).status_code == 200
    time.sleep(1)
    stored = first_token_s(base, "llama-10m")
    serve.shutdown()
    return {
        "model": "llama-10m",
        "weights_bytes": fetched["bytes"],
        "copy_s": round(fetched["seconds"], 3),
        "first_token_with_copy_s": round(with_copy, 3),
        "first_token_stored_s": round(stored, 3),
        "ratio": round(with_copy / stored, 3),
    }


def table(results: dict) -> str:
    c, t = results["copy"], results["first_token"]
    return "\n".join(
        [
            f"\n### Node-to-node copy of {c['bytes'] / 1e6:.0f} MB (median of {c['runs']} runs)\n",
            "| path | MB/s | seconds per run |",
            "|---|---:|---|",
            f"| Orchard: agent to agent over Ray, sha256 checked | {c['ray_copy_mb_per_s']} | {', '.join(map(str, c['ray_copy_s']))} |",
            f"| `cp -r` on this machine | {c['cp_mb_per_s']} | {', '.join(map(str, c['cp_s']))} |",
            f"| ratio (goal >= 0.8) | {c['ratio']:.2f}x | |",
            *(
                f"| Ray's transfer alone, {depth} chunk(s) of {c['chunk_bytes'] // MIB} MiB in flight, nothing written or hashed | {mbs} | |"
                for depth, mbs in c["transfer_only_mb_per_s_by_read_ahead"].items()
            ),
            f"\n### First token of {t['model']} placed where its weights are not ({t['weights_bytes'] / 1e6:.0f} MB)\n",
            "| case | seconds |",
            "|---|---:|",
            f"| copy + load + first token | {t['first_token_with_copy_s']} |",
            f"| ... of which the copy (the fetched event) | {t['copy_s']} |",
            f"| load + first token (weights stored) | {t['first_token_stored_s']} |",
            f"| ratio | {t['ratio']:.2f}x |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", default="bench/results/fetch.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    models_dir = Path("models").resolve()
    prepare(models_dir, only={"llama-10m"}, log=lambda *_: None)
    root = Path(tempfile.mkdtemp(prefix="orch-fetch-", dir="/tmp"))
    stores = {"head": root / "head", "mac-1": root / "mac-1"}
    stores["mac-1"].mkdir(parents=True)
    make_folder(stores["head"], args.mib)
    shutil.copytree(models_dir / "llama-10m", stores["head"] / "llama-10m")
    os.environ["RAY_TMPDIR"] = str(root)
    cluster = Cluster(initialize_head=True, head_node_args=_node("head", 2, 1, stores["head"]) | {"include_dashboard": False})
    cluster.add_node(**_node("mac-1", 1, 1, stores["mac-1"]))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        results = {"copy": copy_runs(stores, args.runs), "first_token": ttft_runs(models_dir, stores, args.port)}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    results["machine"] = {"python": platform.python_version(), "processor": platform.machine(), "cpus": os.cpu_count()}
    publish(results, table(results), args.json, args.markdown, (HEAD, "\n"))


HEAD = """# Weights between nodes: copy speed and first token

Produced by `make bench-fetch` (`python -m bench.fetch --markdown docs/fetch-benchmark.md`); the JSON is
in `bench/results/fetch.json`. How it measures is in `bench/fetch/__main__.py`'s docstring. Local
Ray nodes on one 2-core VM share one disk and one page cache, so the copy here measures Orchard's path
(Ray's object store, chunking, hashing) against the kernel's own copy, not a network.

Where the time goes (the rows below): `cp` copies page cache to page cache at memory speed. Ray's own
transfer of the chunks between the two nodes' object stores, with nothing written or hashed, is the
ceiling of any copy through Ray here, and it is a fraction of `cp`: the goal of 0.8x of `cp` cannot be
met through Ray's object store on this machine. Orchard's copy then loses about half of that to writing
and sha256 (1.2 GB/s on one core here) on the same two cores as both agents, both raylets and both
object managers. What was tried: keeping 4 chunks of 8 MiB in flight instead of one of 16 MiB (the
default now) moved the copy from 300 to 271-300 MB/s, within noise. On a Mac cluster the comparison
that matters is against the link (a Thunderbolt bridge moves 1-2.5 GB/s), with one agent per machine
and the SHA-256 extensions of Apple's cores; it has not been measured.
"""


if __name__ == "__main__":
    main()
