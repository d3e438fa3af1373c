"""`python -m bench.serve.paths`: the model-server actor fed through one channel from another
process (no HTTP, no Serve), against the same engine in-process: what the Ray actor hop alone costs,
with and without a shorter GIL switch interval in the actor, and (--profile-dir) a py-spy record of
the actor's threads. A diagnostic beside bench.serve, which measures the whole HTTP path."""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from cluster.environment import session_token_env  # does not import Ray

os.environ.update(session_token_env())  # Ray's token auth, as every Orchard cluster runs
import ray

from bench.serve.__main__ import closed_loop, engine_one, messages, with_steps
from cluster.model_servers import create_model_server
from deployments.engines.llm import LLMEngine
from deployments.manifest import read_manifest
from deployments.models import prepare
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationRequest
from router.serving.stream_mux import StreamMux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--model", default="llama-10m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gil-switch-ms", default="default,0.5", help="actor variants: 'default' or a switch interval in ms")
    parser.add_argument("--profile-dir", default=None, help="py-spy record of the first actor at the highest concurrency")
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable for --profile-dir")
    parser.add_argument("--json", default="bench/results/serve-paths.json")
    args = parser.parse_args()
    models_dir = Path(args.models_dir).resolve()
    prepare(models_dir, {args.model}, log=lambda *_: None)
    entry = read_manifest(models_dir).entry(args.model)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    node = ray.get_runtime_context().get_node_id()
    variants: dict[str, Any] = {}
    for v in args.gil_switch_ms.split(","):
        options: dict[str, float] = {"coalesce_tokens": 8, "coalesce_ms": 50, "coalesce_max_ms": 100}
        if v != "default":
            options["gil_switch_ms"] = float(v)
        actor = create_model_server(entry, f"paths-{v}", ray_node_id=node, models_dir=str(models_dir), options=options)
        ray.get(actor.load.remote())
        variants[f"actor, GIL switch {v}"] = actor
    engine = LLMEngine(
        args.model, str(models_dir / args.model), max_batch=64, reserve_context_tokens=0
    )  # no KV reservation held (M4 off), as BatchGenerator runs
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    async def measure() -> list[dict]:
        await engine.load()
        mux = StreamMux()

        def via(actor):
            async def one(i: int) -> tuple[int, float]:
                started, first, tokens = time.perf_counter(), None, 0
                stream = mux.open(actor, "bench", GenerationRequest(messages=messages(i), max_tokens=args.max_tokens, temperature=0))
                try:
                    while True:
                        d = await stream.next(120)
                        if isinstance(d, OrchardError):
                            raise d
                        if first is None and d.get("text"):
                            first = time.perf_counter() - started
                        usage = d.get("usage")
                        if usage:
                            tokens = usage.get("completion_tokens", 0)
                        if d.get("finish_reason"):
                            return tokens, first or 0.0
                finally:
                    stream.close()

            return one

        async def engine_counters() -> dict:
            return engine.counters()

        sides = {"in-process": (engine_counters, lambda i: engine_one(engine, i, args.max_tokens))}
        for name, actor in variants.items():

            async def read(actor=actor) -> dict:
                return await actor.counters.remote()

            sides[name] = (read, via(actor))
        for _read, one in sides.values():  # warm-up
            await closed_loop(one, 2, 1.0)
        rows = []
        for c in concurrencies:
            got: dict[str, list] = {name: [] for name in sides}
            for _ in range(args.rounds):
                for name, (counters, one) in sides.items():
                    tokens, seconds, steps = await with_steps(counters, closed_loop(one, c, args.seconds))
                    got[name].append((tokens / seconds, steps))
            base = statistics.median(r for r, _ in got["in-process"])
            for name, runs in got.items():
                rate = statistics.median(r for r, _ in runs)
                row = {
                    "concurrency": c,
                    "side": name,
                    "tok_s": round(rate, 1),
                    "ratio": round(rate / base, 3),
                    "rows_per_step": round(statistics.median(s["rows_per_step"] for _, s in runs), 2),
                    "ms_per_step": round(statistics.median(s["ms_per_step"] for _, s in runs), 2),
                }
                rows.append(row)
                print(f"| {c} | {name} | {row['tok_s']} | {row['ratio']:.2f} | {row['rows_per_step']} | {row['ms_per_step']} |", flush=True)
        if args.profile_dir and shutil.which(args.py_spy):
            first = next(iter(variants.values()))
            pid = await first.__ray_call__.remote(lambda self: os.getpid())
            out = Path(args.profile_dir) / "actor-profile.txt"
            spy = subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(args.seconds)),
                    "-r",
                    "200",
                    "-f",
                    "raw",
                    "--threads",
                    "--nonblocking",
                    "-o",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await closed_loop(via(first), max(concurrencies), args.seconds)
            spy.wait()
        await engine.stop()
        return rows

    rows = asyncio.run(measure())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()
