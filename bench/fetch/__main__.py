"""`python -m bench.fetch` (make bench-fetch): weights moving between node stores on a local 2-node Ray
cluster, against a plain TCP stream of the same bytes between the same two nodes in the same run, and what
a copy adds to the first token of a model placed where its weights are not. Prints a table, writes JSON
(and Markdown with --markdown); its last line is `copy/tcp <ratio>`.

1. Copy: a folder of --mib MiB (random bytes, in files of 64 MiB like a sharded model's) in the head's
   store is copied into mac-1's store by mac-1's node agent, as Orchard copies weights: the head's agent
   opens a stream (cluster/stream.py), sendfile on the head, every file hashed as it arrives, checked
   against the manifest, sealed. Timed from the driver around the `fetch` call.
2. The baseline, a plain TCP stream: one process on the head sends the same files over one connection
   with socket.sendfile, one on mac-1 receives them with recv_into and writes them into files, nothing
   hashed, checked or sealed (timed from the driver around the receiving call, the listener already
   open). That is the fair baseline for a copy: both land the same bytes in files on the target, so
   the ratio prices what Orchard adds (hashing, verifying, resumable partial files, the Ray calls that
   open the stream). The same stream received and thrown away (nothing written) is shown too: the
   link by itself, which on a network is what bounds both.
   Each of the three runs --runs times, in turns; the median of each. All read files the page cache
   holds (written just before); none syncs to disk while timed, and dirty pages are synced before each
   run so that one run's writeback does not land in the next.
3. First token: llama-10m, allowed on mac-1 only, asked for through the Serve app: once with its
   weights only in the head's store (copy + load + first token), then unloaded and asked for again
   (load + first token, the copy is stored now)."""

import argparse
import hashlib
import os
import platform
import shutil
import socket
import statistics
import tempfile
import threading
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
from cluster.node_agent import ensure_agents
from cluster.store import ENV_STORE, MANIFEST, PARTIAL, RECEIVE_BYTES, RECEIVE_DEPTH, Store
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
class PlainTcp:
    """Either end of the baseline: a plain TCP stream of a folder's files, one after another over one
    connection; sendfile on the sending node, recv_into a buffer of Orchard's receive size and write on
    the receiving one."""

    def send(self, folder: str, files: list[str]) -> tuple[str, int]:
        """Listen on this node's address for one connection and send it `files`; (host, port)."""
        host = ray.util.get_node_ip_address()
        listener = socket.create_server((host, 0))

        def serve() -> None:
            conn, _ = listener.accept()
            listener.close()
            with conn:
                for name in files:
                    with (Path(folder) / name).open("rb") as f:
                        conn.sendfile(f)

        threading.Thread(target=serve, daemon=True).start()
        return host, listener.getsockname()[1]

    def receive(self, host: str, port: int, files: list[tuple[str, int]], into: str | None) -> int:
        """Receive `files` (name, size) into the folder `into`, or into nothing (None); the bytes."""
        view = memoryview(bytearray(RECEIVE_BYTES))
        total = 0
        with socket.create_connection((host, port)) as conn:
            for name, size in files:
                out = None
                if into is not None:
                    (Path(into) / name).parent.mkdir(parents=True, exist_ok=True)
                    out = (Path(into) / name).open("wb", buffering=0)
                left = size
                while left:
                    n = conn.recv_into(view[: min(left, len(view))])
                    if not n:
                        raise ConnectionError(f"the sender stopped {left} bytes short of {name}")
                    if out is not None:
                        out.write(view[:n])
                    left -= n
                    total += n
                if out is not None:
                    out.close()
        return total


def _on(node: str) -> NodeAffinitySchedulingStrategy:
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Labels"].get("orchard.node") == node)
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def copy_runs(stores: dict[str, Path], runs: int) -> dict:
    agents = ensure_agents()
    manifest: dict = cast(dict, ray.get(agents["head"].manifest.remote("blob")))  # sealed here once (hashing is not timed)
    total = sum(f["size"] for f in manifest["files"])
    files = [(f["path"], f["size"]) for f in manifest["files"]]
    sender = PlainTcp.options(scheduling_strategy=_on("head")).remote()
    receiver = PlainTcp.options(scheduling_strategy=_on("mac-1")).remote()
    plain = stores["mac-1"].parent / "plain"
    seconds: dict[str, list[float]] = {"orchard": [], "tcp": [], "tcp_recv_only": []}
    transports: set[str] = set()

    def orchard() -> None:
        result = ray.get(agents["mac-1"].fetch.remote(manifest, ["head"]))
        assert result["ok"] and result["bytes"] == total, result
        transports.add(result.get("transport", "?"))

    def tcp(into: Path | None) -> None:
        host, port = ray.get(sender.send.remote(str(stores["head"] / "blob"), [name for name, _ in files]))
        assert ray.get(receiver.receive.remote(host, port, files, None if into is None else str(into))) == total

    cases = {"orchard": orchard, "tcp": lambda: tcp(plain), "tcp_recv_only": lambda: tcp(None)}
    for run in range(runs):
        order = list(cases)[run % 3 :] + list(cases)[: run % 3]  # each goes first in turn
        for name in order:
            Store(stores["mac-1"]).remove("blob")
            shutil.rmtree(plain, ignore_errors=True)
            os.sync()  # the last run's dirty pages written back now, not while this one runs
            started = time.perf_counter()
            cases[name]()
            seconds[name].append(time.perf_counter() - started)
    Store(stores["mac-1"]).remove("blob")
    shutil.rmtree(plain, ignore_errors=True)
    orchard()  # one more copy, untimed, checked once more from outside
    copied = stores["mac-1"] / "blob"
    for f in manifest["files"]:
        assert hashlib.sha256((copied / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert not (stores["mac-1"] / PARTIAL / "blob").exists() and (copied / MANIFEST).exists()
    mbs = {name: round(total / statistics.median(s) / 1e6, 1) for name, s in seconds.items()}
    return {
        "bytes": total,
        "files": len(files),
        "runs": runs,
        "transport": sorted(transports),
        "seconds": {name: [round(x, 3) for x in s] for name, s in seconds.items()},
        "mb_per_s": mbs,
        "ratio": round(mbs["orchard"] / mbs["tcp"], 3),
        "ratio_to_recv_only": round(mbs["orchard"] / mbs["tcp_recv_only"], 3),
        "receive_bytes": RECEIVE_BYTES,
        "receive_depth": RECEIVE_DEPTH,
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
    mbs, secs = c["mb_per_s"], c["seconds"]
    return "\n".join(
        [
            f"\n### Node-to-node copy of {c['bytes'] / 1e6:.0f} MB in {c['files']} files (median of {c['runs']} runs)\n",
            "| path | MB/s | seconds per run |",
            "|---|---:|---|",
            f"| Orchard: agent to agent over its stream ({', '.join(c['transport'])}), sha256 as it arrives, verified, sealed | {mbs['orchard']} | {', '.join(map(str, secs['orchard']))} |",
            f"| plain TCP stream: sendfile -> recv_into + write, nothing hashed | {mbs['tcp']} | {', '.join(map(str, secs['tcp']))} |",
            f"| plain TCP stream received and thrown away (the link alone) | {mbs['tcp_recv_only']} | {', '.join(map(str, secs['tcp_recv_only']))} |",
            f"| copy/tcp (goal >= 0.8) | {c['ratio']:.2f}x | |",
            f"| copy / the link alone | {c['ratio_to_recv_only']:.2f}x | |",
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
    parser.add_argument("--runs", type=int, default=7)
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
    load = os.getloadavg()[0]  # the VM may be shared: what else ran is part of the numbers
    try:
        results = {"copy": copy_runs(stores, args.runs), "first_token": ttft_runs(models_dir, stores, args.port)}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    results["machine"] = {
        "python": platform.python_version(),
        "processor": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min_at_start": round(load, 2),
    }
    publish(results, table(results), args.json, args.markdown, (HEAD, "\n"))
    print(f"copy/tcp {results['copy']['ratio']:.2f}")


HEAD = """# Weights between nodes: copy speed and first token

Produced by `make bench-fetch` (`python -m bench.fetch --markdown docs/fetch-benchmark.md`); the JSON is
in `bench/results/fetch.json`. How it measures is in `bench/fetch/__main__.py`'s docstring.

How a copy moves (cluster/stream.py): the target's node agent asks the source's agent, over a Ray call
that Ray's token authenticates, to open a stream; the source listens on its node's address, on a port
the kernel picks, for the one connection that shows the one-time ticket that call returned, and sends
the files with sendfile. The target writes each piece as it arrives and hashes it on a second thread,
checks every file's sha256 against the source's manifest and seals the folder. Where the stream cannot
be opened it copies through Ray calls, as before; the result's `transport` says which.

The baseline is the same bytes over one plain TCP connection between the same two nodes, sendfile into
recv_into + write, nothing hashed: what any copy of these files over TCP must do. Received and thrown
away, the same stream is the link alone.

What limits the ratio here: both nodes are Ray nodes on one 2-core VM, so the "link" is loopback, the
same two cores copying memory. The plain stream needs about 0.4 CPU-seconds for 537 MB; the copy needs
that plus sha256 of every byte, about 0.33 CPU-seconds more on one core (1.5-1.7 GB/s with SHA-NI), which
is already longer than the whole plain stream takes: copy/tcp cannot reach 0.8 on this machine, whatever
the transport (with a core all to the hash thread, about 0.7 at best). Measured while tuning, in Ray
actors on these nodes: hashing in the receiving thread gave about 0.5x; the hash thread pinned to the
other core 0.6x, unpinned 0.35-0.5x (the scheduler often wakes it on the receiving thread's core), both
on one core 0.2x; a ring of 4 x 4 MiB instead of 4 x 1 MiB made every copy dearer. The VM is shared with other work (the load average at
the start is in the JSON), so single runs vary by 2x or more; the table gives every run. The Ray-call path
this replaces moved about 350 MB/s here. On a Mac cluster the link (10 GbE: 1.2 GB/s; a Thunderbolt
bridge: 1-2.5 GB/s) is the limit rather than the CPU, and the hash has a core of its own; that has not
been measured.
"""


if __name__ == "__main__":
    main()
