"""`python -m bench.peers` (`make bench-peers`): Orchard against the servers a user would compare it
with, on one model, with one load generator, in one run: mlx-lm's own `mlx_lm.server` and vllm-mlx
(continuous batching), each started by this script on a free port, and mlx-lm's BatchGenerator bare in
this process (bench.engine.share's, the ceiling). Closed-loop streaming clients (bench.serve's
SSEClient: aiohttp, one json.loads per event), temperature 1, every request to max_tokens (the
tokens counted from each stream's usage). Prints a table, writes JSON (Markdown with --markdown).

vllm-mlx needs mlx-lm 0.31.x while Orchard pins 0.32.2: it runs from its own site folder
(`--vllm-mlx-site`, made by `make bench-peers`), on top of this venv's other packages."""

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench.serve.__main__ as serve_bench
from bench.engine.share import Bare
from cluster.ports import free_port
from deployments.models import prepare

ROOT = Path(__file__).resolve().parents[2]


# Orchard as shipped, and variants a run may add to --servers to see what a setting buys.
ORCHARDS: dict[str, dict[str, Any]] = {  # app args, and "via": the address the clients use
    "orchard": {},  # the ingress replica's own port (Serve's direct ingress, as shipped)
    "orchard-proxy": {"via": "proxy"},  # through the Serve proxy's port
    "orchard-lease-per-request": {"route_linger_s": 0},  # no standing leases: the residency service is asked per request
    "orchard-hold0": {"llm_engine": {"admit_hold_steps": 0}},  # arrivals join the batch at the next step, never held
    "orchard-hold1": {"llm_engine": {"admit_hold_steps": 1}},  # arrivals held at most 1 step while the batch is busy
    "orchard-hold2": {"llm_engine": {"admit_hold_steps": 2}},  # ... at most 2 steps
    "orchard-pb8": {"llm_engine": {"prefill_batch": 8}},  # prefill groups of at most 8, as the bare loop refills
    "orchard-holdrows16": {"llm_engine": {"admit_hold_min_rows": 16}},  # held only while 16+ rows decode
    "orchard-holdrows32": {"llm_engine": {"admit_hold_min_rows": 32}},  # ... 32+ rows
    "orchard-hold0-pb8": {"llm_engine": {"admit_hold_steps": 0, "prefill_batch": 8}},  # the bare loop's admission: no hold, groups of 8
    "orchard-mpt1024": {"llm_engine": {"max_prefill_tokens": 1024}},  # prefill groups of at most 1,024 uncached tokens (--agent: turns in lockstep)
    "orchard-mpt2048": {"llm_engine": {"max_prefill_tokens": 2048}},  # ... 2,048
    "orchard-igil0.1": {"ingress_gil_switch_ms": 0.1},  # the ingress replica's GIL switch interval 0.1 ms (Python's: 5)
    "orchard-keep0": {"llm_engine": {"prefill_cache_keep_mib": 0}},  # mlx-lm's own: MLX's buffer cache cleared after every prefill chunk
    "orchard-keep1g": {"llm_engine": {"prefill_cache_keep_mib": 1024}},  # 1 GiB of it kept (shipped: the KV reservation)
    "orchard-spec-off": {"llm_engine": {"speculation": "off"}},  # the plain decode step, as BatchGenerator's (shipped: prompt lookup)
}


def without_via(variant: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in variant.items() if k != "via"}


def start_or_report(peer: "Peer", failed: dict[str, str]) -> str | None:
    """The peer started on a free port (its base URL), or None with why in `failed` and printed:
    a peer that does not start is reported, the others still run."""
    try:
        return peer.start(free_port())
    except RuntimeError as e:
        tail = peer.log.read_text(errors="replace")[-1500:] if peer.log.exists() else ""
        failed[peer.name] = f"{e}\n{tail}"
        print(f"  {peer.name} did not start: {e}\n{tail}", flush=True)
        return None


def without_llm_engine(variant: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in variant.items() if k != "llm_engine"}


def wait_ready(base: str, process: subprocess.Popen | None, timeout_s: float = 180.0) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if requests.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} was not ready in {timeout_s:.0f} s")


class Peer:
    """A server in a subprocess: its command, the model name its requests carry."""

    def __init__(self, name: str, command: list[str], model: str, env: dict[str, str] | None = None):
        self.name, self.command, self.model, self.env = name, command, model, env
        self.process: subprocess.Popen | None = None
        self.log = Path(tempfile.gettempdir()) / f"orchard-peer-{name}.log"

    def start(self, port: int) -> str:
        env = dict(os.environ, **blas_env(), **(self.env or {}))
        with open(self.log, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen([*self.command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, self.process)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{self.name}: {e}; its log: {self.log}") from None
        return base

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def blas_env() -> dict[str, str]:
    """The BLAS Orchard's engines use on Linux (deployments/blas.py), for the peers too: without it
    they would run on the mlx[cpu] wheel's reference BLAS, 5-50x slower, and the comparison would
    measure BLAS libraries, not servers. LD_PRELOAD does for a peer what the preload does for Orchard."""
    from deployments.blas import OPENBLAS

    if sys.platform != "linux" or not os.path.exists(OPENBLAS):
        return {}
    return {"LD_PRELOAD": OPENBLAS, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}


def peers(path: Path, vllm_site: Path, home: str) -> list[Peer]:
    py = sys.executable
    return [
        Peer("mlx_lm.server", [py, "-m", "mlx_lm", "server", "--model", str(path), "--decode-concurrency", "64"], str(path)),
        Peer(
            "vllm-mlx",
            [py, "-m", "vllm_mlx.cli", "serve", str(path), "--continuous-batching", "--completion-batch-size", "64"],
            str(path),
            # its own mlx-lm first; an empty HOME, as it writes a prefix cache there when it stops
            env={"PYTHONPATH": os.pathsep.join([str(vllm_site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "HOME": home},
        ),
    ]


async def load(base: str, model: str, streams: int, tokens: int, seconds: float, warmup_s: float = 0.0) -> dict[str, float]:
    client = serve_bench.SSEClient(f"{base}/v1")
    try:
        await client.one(model, 0, 4)  # warm-up
        if warmup_s > 0:  # the same load first, untimed: CUDA compiles kernels per batch shape on first use
            await serve_bench.closed_loop(lambda i: client.one(model, -1 - i, tokens), streams, warmup_s)
        record: dict = {}
        produced, elapsed, ttfts = await serve_bench.closed_loop(lambda i: client.one(model, i, tokens), streams, seconds, record)
    finally:
        await client.close()
    itl = 1000 * statistics.median(record["itl_s"]) if record.get("itl_s") else 0.0
    return {"tok_s": produced / elapsed, "ttft_p50_ms": 1000 * statistics.median(ttfts), "itl_p50_ms": itl}


async def short_requests(base: str, route: str, body: Callable[[int], dict], clients: int, seconds: float) -> dict[str, float]:
    """50 lone requests (their p50 latency), then `clients` closed-loop clients sending short
    requests (a 1-token chat, a 1-string embedding) for `seconds` (requests per second). Every
    request has its own text (`body(i)`): no server answers from an exact-repeat cache."""
    import aiohttp

    url = f"{base}/v1/{route}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sent = 0

        async def one() -> float:
            nonlocal sent
            sent += 1
            started = time.perf_counter()
            async with session.post(url, json=body(sent)) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
                await r.read()
            return time.perf_counter() - started

        for _ in range(5):  # warm-up
            await one()
        lone = sorted([await one() for _ in range(50)])
        deadline = time.perf_counter() + seconds
        done = 0

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await one()
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        rate = done / (time.perf_counter() - started)
    return {"req_s": rate, "lone_p50_ms": 1000 * lone[len(lone) // 2]}


def measure(name: str, run: Callable[[int], dict[str, float]], streams: list[int], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in streams:
        runs = [run(n) for _ in range(rounds)]
        out[str(n)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"rounds": runs}
        print(f"  {name:14} {n:3} streams: {out[str(n)]['tok_s']:8.1f} tok/s, TTFT p50 {out[str(n)]['ttft_p50_ms']:7.1f} ms", flush=True)
    return out


def interleaved(
    a: argparse.Namespace, path: Path, wanted: list[str], bare_run: Callable[[int], dict[str, float]]
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Every wanted server up at once, then `a.rounds` rounds, each running every stream count on
    every server and on bare, in an order rotated by one each round. Orchard variants share one
    local cluster, so they may differ only in `llm_engine`: each that sets one serves the model
    under its own registry name (MODEL.VARIANT) with that scheduling over the defaults, an instance
    of its own. Returns the servers' results, the failures, bare's results."""
    orchards = [n for n in ORCHARDS if n in wanted]
    rest = {json.dumps(without_llm_engine(ORCHARDS[n]), sort_keys=True) for n in orchards}
    if len(rest) > 1:
        raise SystemExit(f"--interleave: Orchard variants in one run may differ only in llm_engine, not {', '.join(orchards)}")
    runners: dict[str, Callable[[int], dict[str, float]]] = {"bare": bare_run}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as up, tempfile.TemporaryDirectory(prefix="orchard-peers-home-") as home:
        if orchards:
            print(f"starting {', '.join(orchards)}", flush=True)
            common = without_llm_engine(ORCHARDS[orchards[0]])  # the app's args: llm_engine at its defaults
            served = {n: f"{a.model}.{n}" if ORCHARDS[n].get("llm_engine") else a.model for n in orchards}
            aliases = {served[n]: (a.model, ORCHARDS[n]["llm_engine"]) for n in orchards if served[n] != a.model}
            cluster, base = serve_bench.start_orchard(
                a.models_dir.resolve(), [a.model], without_via(common), common.get("via", "direct"), aliases=aliases
            )
            up.callback(serve_bench.stop_orchard, cluster)
            for name in orchards:
                runners[name] = functools.partial(_through, base, served[name], a)
        for peer in peers(path, a.vllm_mlx_site, home):
            if peer.name not in wanted:
                continue
            print(f"starting {peer.name}", flush=True)
            url = start_or_report(peer, failed)
            if url is None:
                continue
            up.callback(peer.stop)
            runners[peer.name] = functools.partial(_through, url, peer.model, a)
        runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {n: [] for n in a.streams} for name in runners}
        names = list(runners)
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in a.streams:
                for name in order:
                    x = runners[name](n)
                    runs[name][n].append(x)
                    print(
                        f"  round {r + 1} {name:14} {n:3} streams: {x['tok_s']:8.1f} tok/s, TTFT p50 {x['ttft_p50_ms']:7.1f} ms, ITL p50 {x.get('itl_p50_ms', 0.0):6.2f} ms",
                        flush=True,
                    )
    summary: dict[str, dict[str, dict[str, Any]]] = {
        name: {str(n): {k: statistics.median(x[k] for x in xs) for k in xs[0]} | {"rounds": xs} for n, xs in by_n.items()}
        for name, by_n in runs.items()
    }
    bare = summary.pop("bare")
    for by_n in summary.values():  # each round's ratio to bare's turn in that same round
        for n, cell in by_n.items():
            cell["over_bare_rounds"] = [x["tok_s"] / b["tok_s"] for x, b in zip(cell["rounds"], bare[n]["rounds"], strict=True)]
            cell["over_bare"] = statistics.median(cell["over_bare_rounds"])
    return summary, failed, bare


def _through(base: str, model: str, a: argparse.Namespace, n: int) -> dict[str, float]:
    return asyncio.run(load(base, model, n, a.tokens, a.seconds, a.warmup_seconds))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--agent" in args:  # the agent-shaped workload: its own options (bench/peers/agent.py)
        from bench.peers.agent import main as agent_main

        return agent_main([x for x in args if x != "--agent"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-seconds", type=float, default=0.0, help="an untimed run of each cell first (2 on a GPU: kernels compile per shape)")
    ap.add_argument("--servers", default="orchard,mlx_lm.server,vllm-mlx")
    ap.add_argument("--vllm-mlx-site", type=Path, default=ROOT / ".peers" / "vllm-mlx")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="start every server first, then run the cells in turns (round by round, each stream count, every server and bare; "
        "the order rotated each round), so a machine whose speed drifts (the H200's moved by a quarter within a run) weighs on all alike",
    )
    ap.add_argument("--agent", action="store_true", help="the agent-shaped workload instead (bench/peers/agent.py; its own options: --agent --help)")
    ap.add_argument("--short", action="store_true", help="short requests instead (issue 11's goal 3): 1-token chats and 1-string embeddings")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32], help="--short: concurrent clients")
    ap.add_argument("--embedding-model", default="all-minilm-l6-v2")
    ap.add_argument("--json", type=Path, default=None, help="default: bench/results/peers.json (peers-short.json with --short)")
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.short:
        return short_main(a)
    a.json = a.json or ROOT / "bench" / "results" / "peers.json"
    serve_bench.TEMPERATURE = a.temperature
    prepare(a.models_dir, {a.model}, log=lambda *_: None)
    path = (a.models_dir / a.model).resolve()
    wanted = a.servers.split(",")
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}
    bare = Bare(str(path), max(64, *a.streams), a.temperature)
    bare.run(2, 4, 0.0)

    def bare_run(n: int) -> dict[str, float]:
        bare.run(n, a.tokens, a.warmup_seconds)  # every batch shape compiled first (CUDA builds kernels on first use)
        r = bare.run(n, a.tokens, a.seconds)
        return {"tok_s": r["tok_s"], "ttft_p50_ms": r["ttft_p50_ms"], "itl_p50_ms": r["itl_p50_ms"]}

    if a.interleave:
        results, failed, bare_all = interleaved(a, path, wanted, bare_run)
        bare_ref = {n: bare_all[n]["tok_s"] for n in bare_all}
        bare_ttft = {n: bare_all[n]["ttft_p50_ms"] for n in bare_all}
        bare_itl = {n: bare_all[n]["itl_p50_ms"] for n in bare_all}
        return report(a, results, failed, {"tok_s": bare_ref, "ttft_p50_ms": bare_ttft, "itl_p50_ms": bare_itl, "interleaved": bare_all})
    print("bare BatchGenerator, in process (first)", flush=True)
    first_bare = measure("bare", bare_run, a.streams, a.rounds)
    for name, app_args in ORCHARDS.items():
        if name not in wanted:
            continue
        print(name, flush=True)
        cluster, base = serve_bench.start_orchard(a.models_dir.resolve(), [a.model], without_via(app_args), app_args.get("via", "direct"))

        def through_orchard(n: int, base: str = base) -> dict[str, float]:
            return asyncio.run(load(base, a.model, n, a.tokens, a.seconds, a.warmup_seconds))

        try:
            results[name] = measure(name, through_orchard, a.streams, a.rounds)
        finally:
            serve_bench.stop_orchard(cluster)
    with tempfile.TemporaryDirectory(prefix="orchard-peers-home-") as home:
        for peer in peers(path, a.vllm_mlx_site, home):
            if peer.name not in wanted:
                continue
            print(peer.name, flush=True)
            url = start_or_report(peer, failed)
            if url is None:
                continue

            def through(n: int, base: str = url, model: str = peer.model) -> dict[str, float]:
                return asyncio.run(load(base, model, n, a.tokens, a.seconds, a.warmup_seconds))

            try:
                results[peer.name] = measure(peer.name, through, a.streams, a.rounds)
            finally:
                peer.stop()
    print("bare BatchGenerator, in process (last)", flush=True)
    last_bare = measure("bare", bare_run, a.streams, a.rounds)
    bare_ref = {n: statistics.median([first_bare[n]["tok_s"], last_bare[n]["tok_s"]]) for n in first_bare}
    bare_ttft = {n: statistics.median([first_bare[n]["ttft_p50_ms"], last_bare[n]["ttft_p50_ms"]]) for n in first_bare}
    bare_itl = {n: statistics.median([first_bare[n]["itl_p50_ms"], last_bare[n]["itl_p50_ms"]]) for n in first_bare}
    return report(a, results, failed, {"tok_s": bare_ref, "ttft_p50_ms": bare_ttft, "itl_p50_ms": bare_itl, "first": first_bare, "last": last_bare})


def report(a: argparse.Namespace, results: dict[str, Any], failed: dict[str, str], bare: dict[str, Any]) -> int:
    """The rows (each server's tok/s over bare's), the JSON, the table, the Markdown."""
    bare_ref = bare["tok_s"]
    rows = []
    for server, by_streams in results.items():
        for n, r in by_streams.items():
            rows.append(
                {
                    "server": server,
                    "streams": int(n),
                    "tok_s": round(r["tok_s"], 1),
                    # interleaved: the median of each round's ratio; else to the median of bare's runs
                    "over_bare": round(r.get("over_bare", r["tok_s"] / bare_ref[n]), 3),
                    "ttft_p50_ms": round(r["ttft_p50_ms"], 1),
                    "itl_p50_ms": round(r.get("itl_p50_ms", 0.0), 2),
                }
            )
    result = {
        "model": a.model,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "seconds": a.seconds,
        "rounds": a.rounds,
        "interleaved": a.interleave,
        "bare": bare,
        "rows": rows,
        "raw": results,
        "failed": failed,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cores": os.cpu_count()},
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    print(text)
    if a.markdown is not None:
        machine, cpu_note = where()
        head = HEAD.format(
            model=a.model, tokens=a.tokens, temperature=a.temperature, seconds=a.seconds, rounds=a.rounds, where=machine, cpu_note=cpu_note
        )
        if a.interleave:
            head = head.replace("Each server runs alone", "Every server is up at once and the cells take turns (`--interleave`)")
            head = head.replace("before and after the servers: the ceiling", "taking its turn in every round: the ceiling")
        old = a.markdown.read_text() if a.markdown.exists() else ""
        kept = old[old.index("\n## ") :] if "\n## " in old else ""  # sections of their own (--agent's) stay
        a.markdown.write_text(head + text + kept)
        print(f"wrote {a.markdown}")
    return 0


def short_main(a: argparse.Namespace) -> int:
    """Short requests on one node: Orchard against vllm-mlx (mlx_lm.server serves no embeddings),
    and what one lease round trip to the residency service costs from a driver."""
    prepare(a.models_dir, {a.model, a.embedding_model}, log=lambda *_: None)
    path = (a.models_dir / a.model).resolve()
    emb_path = (a.models_dir / a.embedding_model).resolve()

    def chat(model: str) -> Callable[[int], dict]:
        return lambda i: {"model": model, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 1, "temperature": 0}

    def emb(model: str) -> Callable[[int], dict]:
        return lambda i: {"model": model, "input": f"one short string, number {i}"}

    results: dict[str, Any] = {}

    def run_all(name: str, base: str, chat_model: str, emb_model: str) -> None:
        out = {}
        for kind, route, body in (
            ("chat", "chat/completions", chat(chat_model)),
            ("embeddings", "embeddings", emb(emb_model)),
        ):
            for n in a.clients:
                r = asyncio.run(short_requests(base, route, body, n, a.seconds))
                out[f"{kind}@{n}"] = r
                print(f"  {name:9} {kind:10} {n:3} clients: {r['req_s']:7.1f} req/s, lone p50 {r['lone_p50_ms']:6.1f} ms", flush=True)
        results[name] = out

    for name, app_args in ORCHARDS.items():
        if name not in a.servers.split(","):
            continue
        cluster, base = serve_bench.start_orchard(
            a.models_dir.resolve(), [a.model, a.embedding_model], without_via(app_args), app_args.get("via", "direct")
        )
        try:
            run_all(name, base, a.model, a.embedding_model)
            if name == "orchard":
                results["orchard_lease_round_trip_ms"] = asyncio.run(lease_round_trip(a.model))
                print(f"  orchard lease acquire + release from a driver, p50: {results['orchard_lease_round_trip_ms']:.2f} ms", flush=True)
        finally:
            serve_bench.stop_orchard(cluster)
    if "vllm-mlx" in a.servers.split(","):
        with tempfile.TemporaryDirectory(prefix="orchard-peers-home-") as home:
            peer = next(p for p in peers(path, a.vllm_mlx_site, home) if p.name == "vllm-mlx")
            peer.command += ["--embedding-model", str(emb_path)]
            base = peer.start(free_port())
            try:
                run_all("vllm-mlx", base, str(path), str(emb_path))
            finally:
                peer.stop()
    out = a.json or ROOT / "bench" / "results" / "peers-short.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "embedding_model": a.embedding_model, "seconds": a.seconds, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


async def lease_round_trip(model: str, n: int = 50) -> float:
    """p50 ms of one acquire + release on the residency service through its Serve handle, the hop
    every request makes today (issue 11: no controller round trip per request)."""
    from ray import serve

    from deployments.wire.leases import Grant

    handle = serve.get_deployment_handle("ResidencyService", app_name="orchard")
    times = []
    for _ in range(n + 5):
        started = time.perf_counter()
        grant = await handle.acquire.remote(model)
        if not isinstance(grant, Grant):
            raise RuntimeError(f"the residency service refused {model}: {grant}")
        await handle.release.remote(grant.lease.lease_id)
        times.append(time.perf_counter() - started)
    await handle.shutdown_async()  # on this loop: serve.shutdown() later cannot reach a closed one
    return 1000 * statistics.median(times[5:])


def render(r: dict) -> str:
    lines = [
        "| server | streams | tok/s | / bare BatchGenerator | TTFT p50 ms (bare's) | inter-token p50 ms (bare's) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for x in sorted(r["rows"], key=lambda x: (x["streams"], x["server"])):
        n = str(x["streams"])
        itl = f"{x.get('itl_p50_ms', 0.0):.2f} ({r['bare'].get('itl_p50_ms', {}).get(n, 0.0):.2f})"
        lines.append(
            f"| {x['server']} | {n} | {x['tok_s']:,.1f} | {x['over_bare']:.2f} | {x['ttft_p50_ms']} ({r['bare']['ttft_p50_ms'][n]:.1f}) | {itl} |"
        )
    bare = ", ".join(f"{n} streams {v:,.1f}" for n, v in r["bare"]["tok_s"].items())
    runs = (
        "of its rounds, taking turns with the servers (each ratio is the median of the rounds' own ratios)"
        if r.get("interleaved")
        else "of the runs before and after the servers"
    )
    return "\n".join(lines) + f"\n\nThe bare BatchGenerator in process, median {runs}: {bare} tok/s.\n"


HEAD = """# Orchard against its peers

Produced by `make bench-peers` (`python -m bench.peers --markdown docs/peers-benchmark.md`); JSON in
`bench/results/peers.json`. One run on {where}: the {model} model,
closed-loop streaming chat clients (aiohttp), temperature {temperature}, {tokens} tokens a request,
{seconds:.0f} s per cell, median of {rounds} rounds. Each server runs alone, started by the script:
Orchard (its Serve app on a one-node Ray cluster, as bench.serve runs it; the clients use the
ingress replica's own port, Serve's direct ingress as shipped), `mlx_lm.server`
(`--decode-concurrency 64`) and vllm-mlx 0.6.0 (`--continuous-batching --completion-batch-size 64`,
from its own site folder with mlx-lm 0.31.3). "bare" is mlx-lm's BatchGenerator driven in the
benchmark process with the same prompts, before and after the servers: the ceiling.{cpu_note}

"""
CPU_NOTE = """ The client
shares the cores with every server; on this machine the engine computes on the CPU, so a server's
own processes take from its engine. Every server computes with the same BLAS: Debian's OpenBLAS, one
thread (Orchard preloads it, deployments/blas.py; the peers get it through LD_PRELOAD)."""


def where() -> tuple[str, str]:
    """The machine in words, and the CPU remark when the engine computes on the CPU."""
    import mlx.core as mx

    cores = os.cpu_count()
    if mx.default_device() == mx.gpu:
        return f"{mx.device_info().get('device_name', 'a GPU')} (MLX on the GPU), {cores} cores", ""
    return f"this {cores}-core {platform.system()} machine (CPU MLX, OpenBLAS)", CPU_NOTE


if __name__ == "__main__":
    raise SystemExit(main())
