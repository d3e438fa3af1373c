"""`python -m bench.fetch` (make bench-fetch): weights moving between node stores on a local 2-node Ray
cluster, against a plain TCP stream of the same bytes between the same two nodes in the same run, and what
a copy adds to the first token of a model placed where its weights are not. Prints a table, writes JSON
(and Markdown with --markdown); its last line is `copy/tcp <ratio>`.

1. Copy: a folder of --mib MiB (random bytes, in files of 64 MiB like a sharded model's) in the head's
   store is copied into mac-1's store by mac-1's node agent, as Orchard copies weights: the head's agent
   opens a stream (cluster/stream.py), mac-1's opens its lanes (as many connections as mac-1's
   copy_lanes(), or --lanes), sendfile on the head, every file hashed as it arrives, checked against the
   manifest, sealed. Timed from the driver around the `fetch` call. When the copy uses more than one
   lane, the same copy over one lane is timed too.
2. The baseline, a plain TCP stream: one process on the head sends the same files over one connection
   with socket.sendfile, one on mac-1 receives them with recv_into and writes them into files, nothing
   hashed, checked or sealed (timed from the driver around the receiving call, the listener already
   open). That is the fair baseline for a copy: both land the same bytes in files on the target, so
   the ratio prices what Orchard adds (hashing, verifying, resumable partial files, the Ray calls that
   open the stream). The same stream received and thrown away (nothing written) is shown too: the
   link by itself, which on a network is what bounds both.
   Each case runs --runs times, in turns; the median of each. All read files the page cache holds
   (written just before); none syncs to disk while timed, and dirty pages are synced before each run
   so that one run's writeback does not land in the next. One copy before the timed ones, untimed, is
   checked from outside (every file's sha256, the manifest, no partial folder left).
3. First token (skipped with --no-first-token, which needs neither MLX nor the Serve stack): llama-10m,
   allowed on mac-1 only, asked for through the Serve app: once with its weights only in the head's
   store (copy + load + first token), then unloaded and asked for again (load + first token, the copy
   is stored now).

With --markdown the page also shows the run kept in bench/results/fetch-h200.json (the same benchmark on
a 16-core host, `--no-first-token --mib 2048 --json ...`), when that file is there."""

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

from cluster.environment import session_token_env  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bench.report import publish
from cluster.environment import SERVE_ENV
from cluster.node_agent import ensure_agents
from cluster.receiving import RECEIVE_BYTES, RECEIVE_DEPTH
from cluster.store import ENV_STORE, PARTIAL, Store
from cluster.stored import MANIFEST

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


def copy_runs(stores: dict[str, Path], runs: int, lanes: int | None) -> dict:
    agents = ensure_agents()
    manifest: dict = cast(dict, ray.get(agents["head"].manifest.remote("blob")))  # sealed here once (hashing is not timed)
    total = sum(f["size"] for f in manifest["files"])
    files = [(f["path"], f["size"]) for f in manifest["files"]]
    sender = PlainTcp.options(scheduling_strategy=_on("head")).remote()
    receiver = PlainTcp.options(scheduling_strategy=_on("mac-1")).remote()
    plain = stores["mac-1"].parent / "plain"
    transports: set[str] = set()

    def orchard(lanes: int | None) -> int:
        result = ray.get(agents["mac-1"].fetch.remote(manifest, ["head"], lanes=lanes))
        assert result["ok"] and result["bytes"] == total, result
        transports.add(result.get("transport", "?"))
        return result.get("lanes", 1)

    def tcp(into: Path | None) -> None:
        host, port = ray.get(sender.send.remote(str(stores["head"] / "blob"), [name for name, _ in files]))
        assert ray.get(receiver.receive.remote(host, port, files, None if into is None else str(into))) == total

    used = orchard(lanes)  # untimed, checked from outside
    copied = stores["mac-1"] / "blob"
    for f in manifest["files"]:
        assert hashlib.sha256((copied / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert not (stores["mac-1"] / PARTIAL / "blob").exists() and (copied / MANIFEST).exists()
    cases = {"orchard": lambda: orchard(lanes)} | ({"orchard_one_lane": lambda: orchard(1)} if used > 1 else {})
    cases |= {"tcp": lambda: tcp(plain), "tcp_recv_only": lambda: tcp(None)}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(runs):
        order = list(cases)[run % len(cases) :] + list(cases)[: run % len(cases)]  # each goes first in turn
        for name in order:
            Store(stores["mac-1"]).remove("blob")
            shutil.rmtree(plain, ignore_errors=True)
            os.sync()  # the last run's dirty pages written back now, not while this one runs
            started = time.perf_counter()
            cases[name]()
            seconds[name].append(time.perf_counter() - started)
    Store(stores["mac-1"]).remove("blob")
    shutil.rmtree(plain, ignore_errors=True)
    mbs = {name: round(total / statistics.median(s) / 1e6, 1) for name, s in seconds.items()}
    return {
        "bytes": total,
        "files": len(files),
        "runs": runs,
        "transport": sorted(transports),
        "lanes": used,
        "seconds": {name: [round(x, 3) for x in s] for name, s in seconds.items()},
        "mb_per_s": mbs,
        "ratio": round(mbs["orchard"] / mbs["tcp"], 3),
        "ratio_one_lane": round(mbs.get("orchard_one_lane", mbs["orchard"]) / mbs["tcp"], 3),
        "ratio_to_recv_only": round(mbs["orchard"] / mbs["tcp_recv_only"], 3),
        "receive_bytes": RECEIVE_BYTES,
        "receive_depth": RECEIVE_DEPTH,
    }


def first_token_s(base: str, model: str) -> float:
    import requests

    body: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                return time.perf_counter() - started
    raise RuntimeError("no token")


def ttft_runs(models_dir: Path, stores: dict[str, Path], port: int) -> dict:
    import requests
    from ray import serve

    from router.api.builder import build_app
    from router.residency.registry import from_manifest

    llama = next(m for m in from_manifest(models_dir, {"llama-10m": {"reserve_context_tokens": 2048}}) if m["name"] == "llama-10m")
    llama = llama | {"policy": llama.get("policy", {}) | {"allowed_nodes": ["mac-1"]}}
    policy = {
        "min_residency_s": 0,
        "residency_per_reload": 0,
        "safety_margin_bytes": 16 * MIB,
        "safety_margin_fraction": 0,
        "instance_overhead_bytes": 64 * MIB,
    }
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


def copy_table(c: dict) -> list[str]:
    mbs, secs = c["mb_per_s"], c["seconds"]
    lanes = c.get("lanes", 1)
    rows = [
        f"| Orchard: agent to agent over its stream ({', '.join(c['transport'])}, {lanes} lane{'s' if lanes > 1 else ''}), sha256 as it arrives, verified, sealed | {mbs['orchard']} | {', '.join(map(str, secs['orchard']))} |"
    ]
    if "orchard_one_lane" in mbs:
        rows.append(f"| ... the same over one lane | {mbs['orchard_one_lane']} | {', '.join(map(str, secs['orchard_one_lane']))} |")
    return [
        f"\n### Node-to-node copy of {c['bytes'] / 1e6:.0f} MB in {c['files']} files (median of {c['runs']} runs)\n",
        "| path | MB/s | seconds per run |",
        "|---|---:|---|",
        *rows,
        f"| plain TCP stream: sendfile -> recv_into + write, nothing hashed | {mbs['tcp']} | {', '.join(map(str, secs['tcp']))} |",
        f"| plain TCP stream received and thrown away (the link alone) | {mbs['tcp_recv_only']} | {', '.join(map(str, secs['tcp_recv_only']))} |",
        f"| copy/tcp (goal >= 0.8) | {c['ratio']:.2f}x | |",
        *([f"| ... over one lane | {c['ratio_one_lane']:.2f}x | |"] if "orchard_one_lane" in mbs else []),
        f"| copy / the link alone | {c['ratio_to_recv_only']:.2f}x | |",
    ]


def table(results: dict) -> str:
    lines = copy_table(results["copy"])
    if (t := results.get("first_token")) is not None:
        lines += [
            f"\n### First token of {t['model']} placed where its weights are not ({t['weights_bytes'] / 1e6:.0f} MB)\n",
            "| case | seconds |",
            "|---|---:|",
            f"| copy + load + first token | {t['first_token_with_copy_s']} |",
            f"| ... of which the copy (the fetched event) | {t['copy_s']} |",
            f"| load + first token (weights stored) | {t['first_token_stored_s']} |",
            f"| ratio | {t['ratio']:.2f}x |",
        ]
    return "\n".join(lines)


def other_machine(path: Path) -> str:
    """The section of the page for the run kept at `path` (another machine's), if there is one."""
    if not path.is_file():
        return ""
    kept = json.loads(path.read_text())
    m = kept["machine"]
    name = m.get("name") or f"another machine ({m['cpus']} cores)"
    return "\n".join(
        [
            f"\n\n## On {name}\n",
            f"`{kept.get('command', 'python -m bench.fetch')}`, {kept.get('when', '')}; the JSON is `{path.as_posix()}`. "
            "Ray and pydantic went there as cp312 wheels (the host has neither), on its own Python 3.12.",
            *copy_table(kept["copy"]),
            f"\ncopy/tcp {kept['copy']['ratio']:.2f}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--lanes", type=int, default=None, help="the copy's connections (default: mac-1's copy_lanes())")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--no-first-token", action="store_true", help="only the copy: no model, no MLX, no Serve")
    parser.add_argument("--machine", default=None, help="a name for the machine, kept in the JSON")
    parser.add_argument("--json", default="bench/results/fetch.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    models_dir = Path("models").resolve()
    if not args.no_first_token:
        from deployments.models import prepare

        prepare(models_dir, only={"llama-10m"}, log=lambda *_: None)
    root = Path(tempfile.mkdtemp(prefix="orch-fetch-", dir="/tmp"))
    stores = {"head": root / "head", "mac-1": root / "mac-1"}
    stores["mac-1"].mkdir(parents=True)
    make_folder(stores["head"], args.mib)
    if not args.no_first_token:
        shutil.copytree(models_dir / "llama-10m", stores["head"] / "llama-10m")
    os.environ["RAY_TMPDIR"] = str(root)
    cluster = Cluster(initialize_head=True, head_node_args=_node("head", 2, 1, stores["head"]) | {"include_dashboard": False})
    cluster.add_node(**_node("mac-1", 1, 1, stores["mac-1"]))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    load = os.getloadavg()[0]  # the VM may be shared: what else ran is part of the numbers
    try:
        results: dict = {"copy": copy_runs(stores, args.runs, args.lanes)}
        results["first_token"] = None if args.no_first_token else ttft_runs(models_dir, stores, args.port)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    results["machine"] = {
        "python": platform.python_version(),
        "processor": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min_at_start": round(load, 2),
    } | ({"name": args.machine} if args.machine else {})
    results["command"] = "python -m bench.fetch " + " ".join(sys.argv[1:])
    results["when"] = time.strftime("%Y-%m-%d", time.gmtime())
    publish(results, table(results), args.json, args.markdown, (HEAD, other_machine(Path("bench/results/fetch-h200.json")) + "\n"))
    print(f"copy/tcp {results['copy']['ratio']:.2f}")


HEAD = """# Weights between nodes: copy speed and first token

Produced by `make bench-fetch` (`python -m bench.fetch --markdown docs/fetch-benchmark.md`); the JSON is
in `bench/results/fetch.json`. How it measures is in `bench/fetch/__main__.py`'s docstring. The same
benchmark on a 16-core host is at the end of this page.

How a copy moves (cluster/stream.py): the target's node agent asks the source's agent, over a Ray call
that Ray's token authenticates, to open a stream; the source listens on its node's address, on a port
the kernel picks, for the connections that show the one-time ticket that call returned. The target splits
the files it lacks into lanes (balanced by bytes, a file never split) and opens one connection per lane;
the source sends each lane's files back to back with sendfile. Each lane receives with recv_into into a
ring of four reusable 1 MiB buffers, writes each piece as it arrives, and hashes on a thread of its own
(hashlib releases the GIL), so a lane keeps about two cores busy and lanes side by side use more. Every
file's sha256 is checked against the source's manifest before the folder is sealed; partial files stay
for a resume. A node copies over `copy_lanes()` lanes: one per two cores, 1 to 4 (`ORCHARD_COPY_LANES`
sets it). Where the stream cannot be opened it copies through Ray calls; the result's `transport` says
which.

The baseline is the same bytes over one plain TCP connection between the same two nodes, sendfile into
recv_into + write, nothing hashed: what a plain copy of these files over TCP does. Received and thrown
away, the same stream is the link alone.

What each part buys, on the 16-core host below (2 GiB in 33 files, one run each, median MB/s):

| lanes | copy | copy/tcp | copy / the link alone |
|---:|---:|---:|---:|
| 1 | 1,299-1,373 | 0.52-0.59x | 0.22-0.24x |
| 2 | 2,601 | 1.13x | 0.44x |
| 4 (its copy_lanes()) | 4,487 | 1.79x | 0.82x |
| 8 | 6,321 | 2.45x | 1.02x |

One lane runs at what one core hashes (sha256 on one of its cores: 1,420 MB/s) while the plain stream
moves 2.3-2.6 GB/s and the link alone 5.4-6.2 GB/s: with verification on one core, no transport reaches
0.8x there. Each lane adds about one core's hash; 8 lanes move what the link alone moves. The baseline
is one connection, the copy several: where one TCP stream fills a network link, lanes add no link, only
hash cores, and the link alone is the bound. Socket buffers: 4 MiB set on both ends moved the same as
Linux's autotuned buffers on that host (5.9-7.0 against 5.9-6.6 GB/s, three tries each), so the stream
leaves them to the kernel (setting them turns autotuning off). (`--lanes N` runs the copy over N lanes;
the JSON of each run is in `bench/results/fetch-h200*.json`.)

Why this VM cannot reach 0.8: both nodes are Ray nodes on one 2-core VM, so the "link" is loopback, the
same two cores copying memory. The plain stream needs about 0.4 CPU-seconds for 537 MB; the copy needs
that plus sha256 of every byte, 0.33 CPU-seconds more (1.5-1.7 GB/s with SHA-NI on one core), which is
longer than the whole plain stream takes. A profile of the receiving agent (py-spy, one lane) shows its
receiving thread waiting for the hash thread about half the time, in recv_into a fifth and in write a
sixth: the hash is the critical path. copy_lanes() is 1 here: two lanes moved 1,050 MB/s against one
lane's 947 in one run (0.53x against 0.48x; `--lanes 2 --no-first-token`), too little for four busy
threads on a node that also serves models. Three runs of `make bench-fetch` here, one after another:
copy/tcp 0.54, 0.46, 0.43 (the copy 812-988 MB/s, the plain stream 1,581-2,167 MB/s); the table below is
the last. The VM is shared with other work (the load average at the start is in the JSON), so single
runs vary by 2x or more; the table gives every run. The Ray-call path moved about 350 MB/s here. On a
Mac cluster the link (10 GbE: 1.2 GB/s; a Thunderbolt bridge: 1-2.5 GB/s) is the limit rather than the
CPU, and a Mac has the cores for its lanes; that has not been measured.
"""


if __name__ == "__main__":
    main()
