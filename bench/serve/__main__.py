"""`python -m bench.serve`: the full path (HTTP -> Serve ingress -> model-server actor) against the
same engine in-process: aggregate decode tok/s at several concurrencies, time to first token on an
idle cluster, and first token of a model not yet loaded against its raw load time. A one-node Ray
cluster with room for every model, so nothing is evicted. Prints a table, writes JSON (Markdown with
--markdown)."""

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from cluster.environment import SERVE_ENV, session_token_env
from cluster.ports import free_port  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs

for _k, _v in SERVE_ENV.items():  # the product's Serve mode
    os.environ.setdefault(_k, _v)

import aiohttp  # noqa: E402
import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from bench.engine.share import Bare, messages  # noqa: E402  (the same prompts on every side)
from bench.sse import Chunks  # noqa: E402
from cluster.model_servers import find_model_server  # noqa: E402
from deployments.engines.llm import LLMEngine  # noqa: E402
from deployments.engines.options import LLMEngineOptions  # noqa: E402
from deployments.models import prepare  # noqa: E402
from deployments.wire.generation import GenerationRequest  # noqa: E402
from router.api.builder import AppArgs, build_app  # noqa: E402
from router.residency.registry import from_manifest  # noqa: E402


class SSEClient:
    """A light streaming chat client: aiohttp and one json.loads per SSE event, as load generators
    such as vLLM's benchmark_serving are written. It shares the 2 cores with the path it measures:
    the openai SDK's per-chunk models cost ~5% of a core at 16 streams, which the engine loses
    (measured: 0.94 with this client against 0.87-0.90 with the SDK, same server; docs/serve-path.md)."""

    def __init__(self, base_url: str):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.session: aiohttp.ClientSession | None = None
        self.timings: list[tuple[float, float, float]] = []  # per request: the ingress's Server-Timing (app, lease, first-delta) in ms

    async def one(self, model: str, i: int, max_tokens: int) -> tuple[int, float]:
        """One streamed chat request: (completion tokens from usage, seconds to the first content)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600))
        body = {
            "model": model,
            "messages": messages(i),
            "max_tokens": max_tokens,
            "temperature": TEMPERATURE,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        first, tokens = None, None
        chunks: Chunks | None = None
        async with self.session.post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            timing = dict(part.strip().split(";dur=") for part in response.headers.get("Server-Timing", "").split(",") if ";dur=" in part)
            if {"app", "lease", "first-delta"} <= timing.keys():
                self.timings.append((float(timing["app"]), float(timing["lease"]), float(timing["first-delta"])))
            chunks = Chunks(response.content)
            async for chunk in chunks:
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if chunks is None or not chunks.done or tokens is None:
            raise RuntimeError("the stream ended without usage and [DONE]")
        return tokens, first or 0.0

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class SDKClient:
    """The official openai client (--client openai): what users run, heavier per chunk."""

    def __init__(self, base_url: str):
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    async def one(self, model: str, i: int, max_tokens: int) -> tuple[int, float]:
        started = time.perf_counter()
        first = None
        tokens = 0
        stream = await self.client.chat.completions.create(  # type: ignore[call-overload]  # plain dict messages, as a client sends them
            model=model, messages=messages(i), max_tokens=max_tokens, temperature=TEMPERATURE, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, first or 0.0

    async def close(self) -> None:
        await self.client.close()


async def engine_one(engine: LLMEngine, i: int, max_tokens: int) -> tuple[int, float]:
    started = time.perf_counter()
    first, tokens = None, 0
    async for d in engine.generate(GenerationRequest(messages=messages(i), max_tokens=max_tokens, temperature=TEMPERATURE)):
        if first is None and d.text:
            first = time.perf_counter() - started
        if d.usage:
            tokens = d.usage.completion_tokens
    return tokens, first or 0.0


async def closed_loop(one, n: int, seconds: float, record: dict | None = None) -> tuple[int, float, list[float]]:
    """n clients, each sending its next request as soon as the last one ends, for `seconds` (a
    request started in time runs to its end): steady-state tokens, elapsed seconds, TTFTs. Steady
    state, not one burst of n, so the ramp-up and the tail of a single round do not dominate.
    `record`, if given, gets each request's seconds from sending to its end ("durations") and how
    late this process's event loop woke a 1 ms timer while the clients ran ("lag_s"): a client
    whose loop is late starts its next request late, which the server would be blamed for; and each
    request's mean inter-token latency, (end - first token) / (tokens - 1) ("itl_s")."""
    started = time.perf_counter()
    deadline = started + seconds
    ttfts: list[float] = []
    durations: list[float] = []
    itls: list[float] = []
    lags: list[float] = []
    running = True

    async def client(k: int) -> int:
        tokens, i = 0, k
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            t, f = await one(i)
            durations.append(time.perf_counter() - sent)
            if t > 1:
                itls.append((durations[-1] - f) / (t - 1))
            tokens += t
            ttfts.append(f)
            i += n
        return tokens

    async def probe() -> None:
        while running:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - asked - 0.001)

    watcher = asyncio.create_task(probe()) if record is not None else None
    try:
        totals = await asyncio.gather(*(client(k) for k in range(n)))
    finally:
        running = False
        if watcher is not None:
            await watcher
    if record is not None:
        record["durations"], record["lag_s"], record["itl_s"] = durations, lags, itls
    return sum(totals), time.perf_counter() - started, ttfts


async def through_http(
    client: "SSEClient | SDKClient", model: str, n: int, max_tokens: int, seconds: float = 0.0, record: dict | None = None
) -> tuple[int, float, list[float]]:
    """n concurrent streams once each (seconds=0), or a closed loop of n clients for `seconds`."""
    if seconds > 0:
        return await closed_loop(lambda i: client.one(model, i, max_tokens), n, seconds, record)
    started = time.perf_counter()
    results = await asyncio.gather(*(client.one(model, i, max_tokens) for i in range(n)))
    return sum(t for t, _ in results), time.perf_counter() - started, [f for _, f in results]


ENGINE_SWITCH_S: float | None = None  # --engine-gil-switch-ms, in seconds
TEMPERATURE = 0.0  # --temperature, every side


async def in_process(engine: LLMEngine, n: int, max_tokens: int, seconds: float = 0.0, record: dict | None = None) -> tuple[int, float, list[float]]:
    if ENGINE_SWITCH_S is not None:
        default = sys.getswitchinterval()
        sys.setswitchinterval(ENGINE_SWITCH_S)
        try:
            return await _in_process(engine, n, max_tokens, seconds, record)
        finally:
            sys.setswitchinterval(default)
    return await _in_process(engine, n, max_tokens, seconds, record)


async def _in_process(engine: LLMEngine, n: int, max_tokens: int, seconds: float = 0.0, record: dict | None = None) -> tuple[int, float, list[float]]:
    if seconds > 0:
        return await closed_loop(lambda i: engine_one(engine, i, max_tokens), n, seconds, record)
    started = time.perf_counter()
    results = await asyncio.gather(*(engine_one(engine, i, max_tokens) for i in range(n)))
    return sum(t for t, _ in results), time.perf_counter() - started, [f for _, f in results]


async def with_steps(read_counters, run, record: dict | None = None) -> tuple[int, float, dict]:
    """Run one side and read the engine's own counters around it: decode rows per step (how full
    the batch was) and wall ms per step (how fast it stepped), to tell a path that starves the
    batch from one that slows the engine down. With `record` (the one `run`'s closed loop fills),
    also a request's round trip: the client's time per request against the engine's own (start()
    to its last delta), the difference being the path's both ways."""
    before = await read_counters()
    started = time.perf_counter()
    tokens, seconds, ttfts = await run
    elapsed = time.perf_counter() - started
    after = await read_counters()
    steps = max(1, after["generation_steps"] - before["generation_steps"])
    rows = (after["generation_tokens"] - before["generation_tokens"]) / steps
    firsts = max(1, after["first_tokens"] - before["first_tokens"])

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    inside = {  # where a first token waits inside the engine (means over the run), against the client's
        "inside_ttft_ms": 1000 * delta("first_token_s") / firsts,
        "inside_admit_wait_ms": 1000 * delta("admit_wait_s") / firsts,
        "inside_admit_prep_ms": 1000 * delta("admit_prep_s") / firsts,
        "join_steps": delta("join_steps") / firsts,  # steps from joining the batch to the first token
    }
    if "submits" in after:  # the model server's share of the path (ModelServer.counters, HTTP side)
        inside["submit_lag_ms"] = 1000 * delta("submit_lag_s") / max(1, delta("submits"))
        inside["first_flush_ms"] = 1000 * delta("first_flush_s") / max(1, delta("first_flushes"))
        inside["taken_ms"] = 1000 * delta("taken_s") / max(1, delta("flushes"))
        inside["flushes_per_s"] = delta("flushes") / elapsed
    if "handoffs" in after:
        inside["handoff_ms"] = 1000 * delta("handoff_s") / max(1, delta("handoffs"))
    if record is not None and record.get("durations"):
        finished = max(1, delta("finished_requests"))
        inside["client_request_ms"] = 1000 * statistics.mean(record["durations"])
        inside["engine_request_ms"] = 1000 * delta("finished_s") / finished
        inside["client_lag_ms"] = 1000 * statistics.mean(record["lag_s"]) if record["lag_s"] else 0.0
        inside["client_lag_p95_ms"] = 1000 * pct(record["lag_s"], 0.95) if record["lag_s"] else 0.0
    return tokens, seconds, {"rows_per_step": rows, "ms_per_step": 1000 * elapsed / steps, "ttfts": ttfts} | inside


PROFILED = {
    "actor": "ray::ModelServer",
    "ingress": "ServeReplica:orchard:Ingress",
    "proxy": "ProxyActor",
    "controller": "ServeReplica:orchard:ResidencyService",
}


def profile(py_spy: str, out: Path, model: str, seconds: float) -> list:
    """py-spy records (raw, per thread) of the path's processes, found by their Ray process titles;
    for the model server also one of only the thread that holds the GIL (`-gil`): whose Python
    work the engine thread waits behind between its evaluations."""
    import psutil

    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, title in PROFILED.items():
        pids = [p.pid for p in psutil.process_iter(["cmdline"]) if any(title in part for part in p.info["cmdline"] or ())]
        for pid in pids[:1]:
            for suffix, extra in [("", [])] + ([("-gil", ["--gil"])] if name == "actor" else []):
                cmd = [py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw", "--threads", "--nonblocking", *extra]
                spies.append(
                    subprocess.Popen([*cmd, "-o", str(out / f"{model}-{name}{suffix}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
    return spies


OVERRIDES = {  # room for 64 streams of 1024 tokens each, as the benchmarks run them
    "llama-10m": {"reserve_context_tokens": 1024, "reserve_concurrency": 64},
    "smollm2-135m-instruct": {"reserve_context_tokens": 512, "reserve_concurrency": 64},
    "llama-1b-shape": {"reserve_context_tokens": 1024, "reserve_concurrency": 64},
    "llama-8b-shape": {"reserve_context_tokens": 1024, "reserve_concurrency": 16},
    # coding-agent prompts (bench.peers --agent --shape): 10 rows of up to 32k tokens
    "llama-64k": {"reserve_context_tokens": 32768, "reserve_concurrency": 10},
    "llama-1b-shape-64k": {"reserve_context_tokens": 32768, "reserve_concurrency": 10},
}


def start_orchard(
    models_dir: Path, models: list[str], app_args: dict, via: str = "direct", aliases: dict[str, tuple[str, dict]] | None = None
) -> tuple[Cluster, str]:
    """Orchard on a one-node Ray cluster started by this process (room for every model, nothing
    evicted), its Serve app on a free port: (the cluster, the base URL). `via`: "direct", the
    ingress replica's own HTTP port (Serve's direct ingress, as shipped: no proxy hop), or "proxy",
    the Serve proxy's port. `aliases`: more registry names, each {alias: (model, its llm_engine)}:
    the same weights under another name, scheduled its own way (an instance of its own)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "labels": {"orchard.node": "head", "orchard.budget_gib": "64"},
            "include_dashboard": False,
            "object_store_memory": 80 << 20,
        },
    )
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    overrides = {name: o for name, o in OVERRIDES.items() if name in models}
    registry = [m for m in from_manifest(models_dir, overrides) if m["name"] in models]
    for alias, (model, scheduling) in (aliases or {}).items():
        base = next(m for m in registry if m["name"] == model)
        registry.append(base | {"name": alias, "llm_engine": scheduling})
    policy = {"safety_margin_bytes": 0, "safety_margin_fraction": 0, "min_residency_s": 0, "residency_per_reload": 0}
    serve.run(build_app({"models_dir": str(models_dir), "models": registry, "policy": policy, **app_args}), name="orchard", route_prefix="/")
    proxy = f"http://127.0.0.1:{port}"
    if via == "proxy":
        return cluster, proxy
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the replica's own server starts after the app is ready
        ingress = requests.get(f"{proxy}/v1/cluster", timeout=30).json().get("ingress") or []
        try:
            if ingress and requests.get(ingress[0]["url"] + "/health", timeout=5).ok:
                return cluster, ingress[0]["url"]
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the ingress replica's direct HTTP port did not answer (RAY_SERVE_ENABLE_DIRECT_INGRESS=1?)")


def stop_orchard(cluster: Cluster) -> None:
    try:
        serve.shutdown()
    except RuntimeError:  # a handle made in an event loop that has closed since: the cluster goes anyway
        pass
    ray.shutdown()
    cluster.shutdown()


def llm_engine_options(text: str) -> dict:
    """`hold=N,pb=N,min=N,rows=N` -> LLMEngineOptions' fields, the rest at their defaults."""
    names = {
        "hold": "admit_hold_steps",
        "quiet": "admit_quiet_steps",
        "pb": "prefill_batch",
        "budget": "max_prefill_tokens",
        "min": "prompt_cache_min_tokens",
        "rows": "admit_hold_min_rows",
    }
    given = {names[k]: int(float(v)) for k, v in (kv.split("=") for kv in text.split(",") if kv)}
    return LLMEngineOptions.model_validate(given).model_dump()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--models", default="llama-10m,smollm2-135m-instruct")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady-state seconds per side per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating in-process / HTTP rounds per cell")
    parser.add_argument("--warmup-seconds", type=float, default=0.0, help="an untimed run of each side per cell first (2 on a GPU)")
    parser.add_argument("--coalesce-tokens", type=int, default=8)
    parser.add_argument("--coalesce-ms", type=float, default=50.0)
    parser.add_argument("--coalesce-max-ms", type=float, default=100.0)
    parser.add_argument("--gil-switch-ms", type=float, default=None, help="the model servers' (default: ray-config's, 0.1)")
    parser.add_argument("--ingress-gil-switch-ms", type=float, default=None, help="the ingress replica's (default: ray-config's, Python's 5)")
    parser.add_argument(
        "--engine-gil-switch-ms", type=float, default=None, help="this process's while the in-process engine runs (default: Python's 5 ms)"
    )
    parser.add_argument("--client", choices=("aiohttp", "openai"), default="aiohttp", help="the load generator (see SSEClient)")
    parser.add_argument("--profile-dir", default=None, help="py-spy records of the path's processes in one more HTTP run")
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (issue 11's runs: 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: 128 for the llamas, 48 for SmolLM2)")
    parser.add_argument("--llm-engine", default="", help="the LLM engines' scheduling, served and in-process: hold=N,pb=N,min=N (default: AppArgs')")
    parser.add_argument("--bare", action="store_true", help="also mlx-lm's BatchGenerator alone in this process (bench.engine.share)")
    parser.add_argument("--json", default="bench/results/serve.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    global ENGINE_SWITCH_S, TEMPERATURE
    TEMPERATURE = args.temperature
    scheduling = llm_engine_options(args.llm_engine)
    ENGINE_SWITCH_S = args.engine_gil_switch_ms / 1000.0 if args.engine_gil_switch_ms is not None else None
    models_dir = Path(args.models_dir).resolve()
    prepare(models_dir, set(args.models.split(",")), log=lambda *_: None)
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    app_args = {
        "coalesce_tokens": args.coalesce_tokens,
        "coalesce_ms": args.coalesce_ms,
        "coalesce_max_ms": args.coalesce_max_ms,
        "llm_engine": scheduling,
    }
    if args.gil_switch_ms is not None:
        app_args["gil_switch_ms"] = args.gil_switch_ms
    if args.ingress_gil_switch_ms is not None:
        app_args["ingress_gil_switch_ms"] = args.ingress_gil_switch_ms
    cluster, base = start_orchard(models_dir, args.models.split(","), app_args)
    rows, ttft, cold = [], [], []
    max_tokens_of = {"llama-10m": 128, "smollm2-135m-instruct": 48, "llama-1b-shape": 128, "llama-8b-shape": 128}
    for model in args.models.split(","):
        max_tokens = args.max_tokens or max_tokens_of[model]
        # as served: its reservation, prefix reuse on
        engine = LLMEngine(model, str(models_dir / model), max_batch=64, **(OVERRIDES.get(model, {}) | scheduling))
        bare = Bare(str(models_dir / model), 64, TEMPERATURE) if args.bare else None
        load_started = time.perf_counter()
        asyncio.run(engine.load())
        raw_load_s = time.perf_counter() - load_started
        # cold: the first request of a model that is not loaded yet, through HTTP
        started = time.perf_counter()
        requests.post(
            f"{base}/v1/chat/completions", json={"model": model, "messages": messages(0), "max_tokens": 1, "temperature": 0}, timeout=600
        ).raise_for_status()
        cold.append({"model": model, "first_token_cold_s": round(time.perf_counter() - started, 3), "raw_load_s": round(raw_load_s, 3)})

        async def measure(model: str, engine: LLMEngine, max_tokens: int, bare: Bare | None) -> None:
            client = (SSEClient if args.client == "aiohttp" else SDKClient)(f"{base}/v1")
            actor = find_model_server(model, "head")

            async def engine_counters() -> dict:
                return engine.counters()

            async def actor_counters() -> dict:
                return await actor.counters.remote()

            await through_http(client, model, 2, 4)  # warm-up
            await in_process(engine, 2, 4)
            http_f, engine_f = [], []
            for _ in range(20):  # idle-cluster TTFT, one request at a time
                _, _, f = await through_http(client, model, 1, 2)
                http_f += f
                _, _, f = await in_process(engine, 1, 2)
                engine_f += f
            ttft.append(
                {
                    "model": model,
                    "http_p50_ms": round(1000 * statistics.median(http_f), 1),
                    "http_p95_ms": round(1000 * pct(http_f, 0.95), 1),
                    "engine_p50_ms": round(1000 * statistics.median(engine_f), 1),
                    "engine_p95_ms": round(1000 * pct(engine_f, 0.95), 1),
                }
            )
            for c in concurrencies:
                # Alternating rounds, median of each: this VM's speed drifts by ~10% over minutes,
                # which one long run of each side would read as a difference of the paths.
                e_rates, h_rates, e_steps, h_steps, b_runs = [], [], [], [], []
                if args.warmup_seconds > 0:  # every side's batch shapes once, untimed (CUDA compiles kernels per shape)
                    if bare is not None:
                        bare.run(c, max_tokens, args.warmup_seconds)
                    await in_process(engine, c, max_tokens, args.warmup_seconds)
                    await through_http(client, model, c, max_tokens, args.warmup_seconds)
                for _ in range(args.rounds):
                    if bare is not None:
                        b_runs.append(bare.run(c, max_tokens, args.seconds))
                    e_rec: dict = {}
                    h_rec: dict = {}
                    e_tokens, e_s, e_step = await with_steps(engine_counters, in_process(engine, c, max_tokens, args.seconds, e_rec), e_rec)
                    mark = len(getattr(client, "timings", ()))
                    h_tokens, h_s, h_step = await with_steps(actor_counters, through_http(client, model, c, max_tokens, args.seconds, h_rec), h_rec)
                    timings = getattr(client, "timings", [])[mark:]
                    if timings:  # the ingress's own split of a first token's wait (its Server-Timing header)
                        h_step["ingress_app_ms"] = statistics.mean(t[0] for t in timings)
                        h_step["ingress_lease_ms"] = statistics.mean(t[1] for t in timings)
                        h_step["ingress_first_delta_ms"] = statistics.mean(t[2] for t in timings)
                    e_rates.append(e_tokens / e_s)
                    h_rates.append(h_tokens / h_s)
                    e_steps.append(e_step)
                    h_steps.append(h_step)
                ratios = sorted(h / e for h, e in zip(h_rates, e_rates, strict=True))
                row: dict[str, Any] = {
                    "model": model,
                    "concurrency": c,
                    "http_tok_s": round(statistics.median(h_rates), 1),
                    "engine_tok_s": round(statistics.median(e_rates), 1),
                }
                row["ratio"] = round(statistics.median(ratios), 3)
                row["ratio_min_max"] = [round(ratios[0], 3), round(ratios[-1], 3)]
                for side, steps in (("engine", e_steps), ("http", h_steps)) + ((("bare", b_runs),) if b_runs else ()):
                    row[f"{side}_rows_per_step"] = round(statistics.median(x["rows_per_step"] for x in steps), 2)
                    row[f"{side}_ms_per_step"] = round(statistics.median(x["ms_per_step"] for x in steps), 2)
                if b_runs:
                    row["bare_tok_s"] = round(statistics.median(x["tok_s"] for x in b_runs), 1)
                    row["bare_ttft_p50_ms"] = round(statistics.median(x["ttft_p50_ms"] for x in b_runs), 1)
                    row["bare_first_token_steps"] = round(statistics.median(x["first_token_steps"] for x in b_runs), 2)
                    row["http_over_bare"] = round(row["http_tok_s"] / row["bare_tok_s"], 3)
                    row["engine_over_bare"] = round(row["engine_tok_s"] / row["bare_tok_s"], 3)
                row["http_ttft_p50_ms"] = round(1000 * statistics.median(f for x in h_steps for f in x["ttfts"]), 1)
                row["engine_ttft_p50_ms"] = round(1000 * statistics.median(f for x in e_steps for f in x["ttfts"]), 1)
                for side, steps in (("engine", e_steps), ("http", h_steps)):
                    # the client's mean TTFT, and the part of it spent inside the engine (from its
                    # start() to the first token; admission's wait first): the rest is the path
                    row[f"{side}_ttft_mean_ms"] = round(1000 * statistics.mean(f for x in steps for f in x["ttfts"]), 1)
                    row[f"{side}_inside_ttft_mean_ms"] = round(statistics.median(x["inside_ttft_ms"] for x in steps), 1)
                    row[f"{side}_inside_admit_wait_mean_ms"] = round(statistics.median(x["inside_admit_wait_ms"] for x in steps), 1)
                    # ... of which preparation (templating and tokenizing, before the MLX thread had it)
                    row[f"{side}_inside_admit_prep_mean_ms"] = round(statistics.median(x["inside_admit_prep_ms"] for x in steps), 1)
                    row[f"{side}_join_steps"] = round(statistics.median(x["join_steps"] for x in steps), 2)
                    # a request's round trip: the client's time per request, the engine's own (start()
                    # to the last delta), the path's both ways (the difference), the client loop's lag
                    keys = ("client_request_ms", "engine_request_ms", "client_lag_ms", "client_lag_p95_ms", "handoff_ms")
                    for key in keys + (
                        "submit_lag_ms",
                        "first_flush_ms",
                        "taken_ms",
                        "flushes_per_s",
                        "ingress_app_ms",
                        "ingress_lease_ms",
                        "ingress_first_delta_ms",
                    ):
                        if all(key in x for x in steps):
                            row[f"{side}_{key}"] = round(statistics.median(x[key] for x in steps), 1)
                    if f"{side}_client_request_ms" in row:
                        row[f"{side}_path_request_ms"] = round(row[f"{side}_client_request_ms"] - row[f"{side}_engine_request_ms"], 1)
                bare_cells = (
                    f" bare {row['bare_tok_s']} (HTTP/bare {row['http_over_bare']:.2f}, engine/bare {row['engine_over_bare']:.2f}) |"
                    if b_runs
                    else ""
                )
                print(
                    f"| {model} | {c} | {row['engine_tok_s']} | {row['http_tok_s']} | {row['ratio']:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
                    f" TTFT p50 ms engine {row['engine_ttft_p50_ms']} / HTTP {row['http_ttft_p50_ms']} |"
                    f" TTFT mean ms (inside the engine; admission's wait, of it preparing) engine {row['engine_ttft_mean_ms']}"
                    f" ({row['engine_inside_ttft_mean_ms']}; {row['engine_inside_admit_wait_mean_ms']}, {row['engine_inside_admit_prep_mean_ms']})"
                    f" / HTTP {row['http_ttft_mean_ms']} ({row['http_inside_ttft_mean_ms']}; {row['http_inside_admit_wait_mean_ms']},"
                    f" {row['http_inside_admit_prep_mean_ms']}) |{bare_cells}",
                    flush=True,
                )
                for line in _round_trip_table([row]) + _path_table([row]):  # the round trip and the path, as they come
                    print(line, flush=True)
                rows.append(row)
            if args.profile_dir:  # one more HTTP run at the highest concurrency, under py-spy
                spies = profile(args.py_spy, Path(args.profile_dir), model, args.seconds)
                await through_http(client, model, concurrencies[-1], max_tokens, args.seconds)
                for spy in spies:
                    spy.wait()
            await client.close()

        asyncio.run(measure(model, engine, max_tokens, bare))
        asyncio.run(engine.stop())
    stop_orchard(cluster)
    result = {
        "client": args.client,
        "gil_switch_ms": {
            "model_server": args.gil_switch_ms if args.gil_switch_ms is not None else AppArgs.model_fields["gil_switch_ms"].default,
            "in_process": args.engine_gil_switch_ms or 5.0,
            "ingress": args.ingress_gil_switch_ms or AppArgs.model_fields["ingress_gil_switch_ms"].default or 5.0,
        },
        "coalesce": {"tokens": args.coalesce_tokens, "ms": args.coalesce_ms, "max_ms": args.coalesce_max_ms},
        "temperature": TEMPERATURE,
        "llm_engine": scheduling,
        "seconds_per_side_per_round": args.seconds,
        "rounds": args.rounds,
        "throughput": rows,
        "ttft": ttft,
        "cold_start": cold,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cores": os.cpu_count()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(HEAD + text)
        print(f"wrote {args.markdown}")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table after a blank line: the first column left-aligned, the rest right."""
    return ["", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)] + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _round_trip_table(rows: list[dict]) -> list[str]:
    """A request's time, the client's against the engine's (the path's both ways), the client loop's
    lag, and the steps from joining to a first token; none where the run did not record them."""
    if not rows or not all("http_path_request_ms" in x for x in rows):
        return []
    return _table(
        [
            "model",
            "concurrency",
            "a request's ms, in-process: client / engine / path",
            "through HTTP: client / engine / path",
            "client loop lag ms, mean (p95), in-process / HTTP",
            "steps from joining to the first token: in-process / HTTP / bare",
        ],
        [
            [
                x["model"],
                x["concurrency"],
                f"{x['engine_client_request_ms']} / {x['engine_engine_request_ms']} / {x['engine_path_request_ms']}",
                f"{x['http_client_request_ms']} / {x['http_engine_request_ms']} / {x['http_path_request_ms']}",
                f"{x['engine_client_lag_ms']} ({x['engine_client_lag_p95_ms']}) / {x['http_client_lag_ms']} ({x['http_client_lag_p95_ms']})",
                f"{x['engine_join_steps']} / {x['http_join_steps']} / {x.get('bare_first_token_steps', '-')}",
            ]
            for x in rows
        ],
    )


def _path_table(rows: list[dict]) -> list[str]:
    """Where a first token's path goes, from the model server's counters and the ingress's Server-Timing."""
    if not rows or not all("http_submit_lag_ms" in x for x in rows):
        return []
    return _table(
        [
            "model",
            "concurrency",
            "through HTTP, ms: the app to the route / the ingress's lease",
            "ingress submit -> model server",
            "engine hand-off -> its event loop (in-process)",
            "first delta -> its flush",
            "flush -> taken by the ingress",
            "flushes / s",
            "ingress: submit -> first delta",
        ],
        [
            [
                x["model"],
                x["concurrency"],
                f"{x.get('http_ingress_app_ms')} / {x.get('http_ingress_lease_ms')}",
                x["http_submit_lag_ms"],
                f"{x['http_handoff_ms']} ({x.get('engine_handoff_ms')})",
                x["http_first_flush_ms"],
                x["http_taken_ms"],
                x["http_flushes_per_s"],
                x.get("http_ingress_first_delta_ms"),
            ]
            for x in rows
        ],
    )


def render(r: dict) -> str:
    t = r["throughput"]
    lines = _table(
        [
            "model",
            "concurrency",
            "engine in-process tok/s",
            "through HTTP tok/s",
            "ratio (median)",
            "ratio min-max",
            "rows / step in-process / HTTP",
            "ms / step in-process / HTTP",
        ],
        [
            [
                x["model"],
                x["concurrency"],
                x["engine_tok_s"],
                x["http_tok_s"],
                f"{x['ratio']:.2f}",
                f"{x['ratio_min_max'][0]:.2f}-{x['ratio_min_max'][1]:.2f}",
                f"{x['engine_rows_per_step']} / {x['http_rows_per_step']}",
                f"{x['engine_ms_per_step']} / {x['http_ms_per_step']}",
            ]
            for x in t
        ],
    )[1:]  # the first table opens the page: no blank line before it
    lines += _table(
        [
            "model",
            "concurrency",
            "TTFT mean ms in-process: client / inside the engine / admission's wait / of it preparing",
            "through HTTP: client / inside the engine / admission's wait / of it preparing",
        ],
        [
            [
                x["model"],
                x["concurrency"],
                f"{x['engine_ttft_mean_ms']} / {x['engine_inside_ttft_mean_ms']} / {x['engine_inside_admit_wait_mean_ms']} / {x['engine_inside_admit_prep_mean_ms']}",
                f"{x['http_ttft_mean_ms']} / {x['http_inside_ttft_mean_ms']} / {x['http_inside_admit_wait_mean_ms']} / {x['http_inside_admit_prep_mean_ms']}",
            ]
            for x in t
        ],
    )
    lines += _round_trip_table(t) + _path_table(t)
    lines += _table(
        ["model", "TTFT HTTP p50 / p95 ms", "TTFT engine p50 / p95 ms"],
        [[x["model"], f"{x['http_p50_ms']} / {x['http_p95_ms']}", f"{x['engine_p50_ms']} / {x['engine_p95_ms']}"] for x in r["ttft"]],
    )
    lines += _table(
        ["model", "first token, model not loaded (s)", "raw load in-process (s)"],
        [[x["model"], x["first_token_cold_s"], x["raw_load_s"]] for x in r["cold_start"]],
    )
    return "\n".join(lines) + "\n"


HEAD = """# Serving path benchmark

Produced by `make bench-serve` (`python -m bench.serve --markdown docs/serve-benchmark.md`); JSON in
`bench/results/serve.json`. One Ray node on this 2-core Linux VM (CPU MLX, OpenBLAS), the Serve app
of ray-config.yaml's shape in Serve's throughput mode (cluster.environment.SERVE_ENV), streaming chat
requests (greedy, max_tokens 128 for the 10M llama and 48 for SmolLM2) from a light aiohttp client
(`--client openai` uses the official SDK instead; docs/serve-path.md, "The load generator").

- "engine in-process" is the same LLMEngine driven in the benchmark process with the same requests
  and settings (prefix reuse on, as served): the ceiling for the path.
- Throughput is steady state: c clients, each sending its next request as soon as the last ends,
  for 10 s; in-process and HTTP alternate for 3 rounds and the table gives the medians (and the
  spread of the per-round ratio): the VM's speed drifts by ~10% over minutes.
- "rows / step" and "ms / step" come from the engine's own counters (mlx-lm's BatchGenerator) on
  each side: how full the batch was, and how long one step took in wall time. A path that starves
  the batch shows in the first, one that slows the engine down in the second.
- The path: one multiplexed channel per ingress replica and model-server actor carries every stream
  (one Ray item per flush); a stream's first delta goes out at once, then every 8 tokens or 50 ms,
  stretched to 100 ms at 16+ streams per instance. The engine hands each step's deltas straight to
  the channel; the model-server actor runs with a 0.1 ms GIL switch interval (`gil_switch_ms`).
- The client, Ray's and Serve's processes, the ingress and the model actor all share the same 2 cores
  with the engine, which on this machine computes on the CPU: every cycle the path spends is taken from the
  engine. On a Mac the engine computes on the GPU.

How the path is built and why, with the measurements behind it: [serve-path.md](serve-path.md); every
current figure, the GPU's included, with its command: [performance.md](performance.md).

"""

if __name__ == "__main__":
    main()
