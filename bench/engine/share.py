"""The engine's share of the serving path (issue 11): mlx-lm's BatchGenerator driven bare in a closed
loop (the ceiling: one shared sampler, pre-tokenized prompts, refills inserted in the step that freed
their slot) against Orchard's LLMEngine driven through its own request API (`generate`: a validated
request, templating and tokenizing, the prompt cache, stop filters, detokenizing, one hand-off per
step) with the same prompts, sampling settings and clients, in one process. No Ray, no HTTP: what is
lost here is the engine's, not the path's.

    python -m bench.engine.share [--model models/llama-10m] [--streams 16 64] [--tokens 128]
        [--temperature 1] [--seconds 8] [--rounds 2] [--py-spy py-spy --profile-dir DIR]

Prints a table and writes JSON (bench/results/engine-share.json). Runs anywhere MLX runs: on the lent
H200 it needs only mlx, mlx-lm, pydantic and llguidance (bench/gpu/run.sh)."""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from bench.engine.__main__ import TOPICS  # the engine benchmark's prompts (MLX only, as here)
from deployments.engines import buffer_cache
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} (number {i})."}]


def _steps(counters: dict, before: dict, elapsed: float) -> dict:
    steps = max(1, counters["generation_steps"] - before["generation_steps"])
    return {
        "rows_per_step": round((counters["generation_tokens"] - before["generation_tokens"]) / steps, 2),
        "ms_per_step": round(1000 * elapsed / steps, 3),
        "decode_ms_per_step": round(1000 * (counters["decode_time"] - before["decode_time"]) / steps, 3),
        "prompt_s": round(counters["prompt_time"] - before["prompt_time"], 3),
    }


class Bare:
    """The ceiling: one BatchGenerator stepped in a loop by this thread, nothing else."""

    def __init__(self, path: str, max_batch: int, temperature: float):
        self.model, self.tokenizer = mlx_lm.load(path)  # type: ignore[misc]  # a 2-tuple without return_config
        self.eos = [[t] for t in self.tokenizer.eos_token_ids]
        self.sampler = make_sampler(temp=temperature) if temperature > 0 else None
        self.max_batch = max_batch
        self.prompts: dict[int, list[int]] = {}

    def prompt(self, i: int) -> list[int]:
        if i not in self.prompts:
            self.prompts[i] = list(self.tokenizer.apply_chat_template(messages(i), add_generation_prompt=True))
        return self.prompts[i]

    def run(self, n: int, max_tokens: int, seconds: float) -> dict:
        with buffer_cache.mlx_lm_own():  # stock mlx-lm, whatever the engine beside it keeps
            return self._run(n, max_tokens, seconds)

    def _run(self, n: int, max_tokens: int, seconds: float) -> dict:
        for i in range(n * 64):
            self.prompt(i % 4096)  # tokenized before the clock starts
        gen = BatchGenerator(self.model, stop_tokens=self.eos, completion_batch_size=max(64, n), prefill_batch_size=8)
        kw: dict[str, Any] = {"samplers": [self.sampler]} if self.sampler is not None else {}
        owner: dict[int, tuple[int, float, int]] = {}  # uid -> (client, inserted at, step count then)
        nxt = list(range(n))
        ttft: list[float] = []
        itl: list[float] = []  # per request: (end - first token) / (tokens - 1), as bench.serve's clients measure it
        first_at: dict[int, tuple[float, int]] = {}  # uid -> (its first token's time, tokens since)

        def insert(k: int) -> None:
            (uid,) = gen.insert([self.prompt(nxt[k] % 4096)], max_tokens=[max_tokens], **kw)
            owner[uid] = (k, time.perf_counter(), steps)
            nxt[k] += n

        started = time.perf_counter()
        deadline = started + seconds
        before = dict(vars(gen._counters))
        steps, first_steps = 0, []  # steps from insertion to a first token (the engine's join_steps)
        for k in range(n):
            insert(k)
        produced = 0
        while owner:
            _, responses = gen.next()
            steps += 1  # a refill inserted below joins in step `steps`, as the engine counts
            for r in responses:
                k, at, step = owner[r.uid]
                if r.uid not in first_at:
                    first_at[r.uid] = (time.perf_counter(), 0)
                    ttft.append(first_at[r.uid][0] - at)
                    first_steps.append(steps - 1 - step)
                produced += r.finish_reason != "stop"
                first, made = first_at[r.uid]
                made += r.finish_reason != "stop"
                first_at[r.uid] = (first, made)
                if r.finish_reason is not None:
                    if made > 1:
                        itl.append((time.perf_counter() - first) / (made - 1))
                    del owner[r.uid], first_at[r.uid]
                    if time.perf_counter() < deadline:
                        insert(k)
        elapsed = time.perf_counter() - started
        out = {"tok_s": produced / elapsed, "ttft_p50_ms": 1000 * statistics.median(ttft), "first_token_steps": statistics.mean(first_steps)}
        out["itl_p50_ms"] = 1000 * statistics.median(itl) if itl else 0.0
        out |= _steps(vars(gen._counters), before, elapsed)
        gen.close()
        return out


async def through_engine(engine: LLMEngine, n: int, max_tokens: int, seconds: float, temperature: float) -> dict:
    """n clients on the engine's own request API, each sending its next request when the last ends."""
    deadline = time.perf_counter() + seconds
    ttft: list[float] = []

    async def client(k: int) -> int:
        tokens, i = 0, k
        while i == k or time.perf_counter() < deadline:  # at least one request each
            sent, first = time.perf_counter(), None
            async for d in engine.generate(GenerationRequest(messages=messages(i % 4096), max_tokens=max_tokens, temperature=temperature)):
                if first is None and (d.token_ids or d.finish_reason):
                    first = time.perf_counter() - sent
                if d.usage:
                    tokens += d.usage.completion_tokens
            ttft.append(first or 0.0)
            i += n
        return tokens

    before = engine.counters()
    started = time.perf_counter()
    totals = await asyncio.gather(*(client(k) for k in range(n)))
    elapsed = time.perf_counter() - started
    after = engine.counters()
    firsts = max(1, after["first_tokens"] - before["first_tokens"])
    out = {
        "tok_s": sum(totals) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "first_token_steps": (after["join_steps"] - before["join_steps"]) / firsts,
    }
    return out | _steps(after, before, elapsed)


def parse_variant(text: str) -> tuple[str, dict[str, float]]:
    name, _, rest = text.partition(":")
    settings = {k: float(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}
    unknown = set(settings) - {"hold", "cache", "min", "gil", "pb", "quiet", "rows", "clear", "keep"}
    if unknown:
        raise SystemExit(f"unknown variant setting(s) {sorted(unknown)} in {text!r}")
    return name, settings


@contextlib.contextmanager
def variant(engine: LLMEngine, settings: dict[str, float]):
    """The engine with one variant's settings for a round, restored after it."""
    saved = (engine.admit_hold_steps, engine._prompt_cache_entries, engine.prompt_cache_min_tokens, engine.prefill_batch, sys.getswitchinterval())
    quiet, min_rows = engine.admit_quiet_steps, engine.admit_hold_min_rows
    engine.admit_quiet_steps = int(settings.get("quiet", quiet))
    engine.admit_hold_min_rows = int(settings.get("rows", min_rows))
    engine.admit_hold_steps = int(settings.get("hold", saved[0]))
    engine._prompt_cache_entries = int(settings.get("cache", saved[1]))
    engine.prompt_cache_min_tokens = int(settings.get("min", saved[2]))
    engine.prefill_batch = engine.generator.prefill_batch_size = int(settings.get("pb", saved[3]))
    if "gil" in settings:
        sys.setswitchinterval(settings["gil"] / 1000.0)
    clear_cache = mx.clear_cache
    if settings.get("clear", 1) == 0:  # nothing cleared: mlx-lm frees MLX's buffer cache after every prefill chunk
        mx.clear_cache = lambda: None
    if "keep" in settings:
        buffer_cache.keep(engine, int(settings["keep"] * 2**20))
    try:
        yield
    finally:
        mx.clear_cache = clear_cache
        buffer_cache.keep(engine, engine.cache_keep_bytes())
        engine.admit_hold_steps, engine._prompt_cache_entries, engine.prompt_cache_min_tokens = saved[:3]
        engine.prefill_batch = engine.generator.prefill_batch_size = saved[3]
        sys.setswitchinterval(saved[4])
        engine.admit_quiet_steps, engine.admit_hold_min_rows = quiet, min_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-10m")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variant",
        nargs="+",
        default=["served"],
        help="engine variants, alternating: NAME or NAME:key=value,... with keys hold (admit_hold_steps), "
        "cache (prompt cache entries: 0 none), min (prompt_cache_min_tokens), pb (prefill_batch), quiet (admit_quiet_steps), rows (admit_hold_min_rows), gil (this process's switch interval, ms), clear (0: mx.clear_cache does nothing, "
        "so mlx-lm's prefill keeps all of MLX's buffer cache), keep (MiB of it the engine keeps; 0: mlx-lm's own clearing)",
    )
    ap.add_argument("--prompt-cache", type=int, default=16, help="the engine's prompt_cache_entries (16 as served; 0: none)")
    ap.add_argument("--profile-dir", type=Path, default=None, help="py-spy record of this process in one more engine round per cell")
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "engine-share.json")
    a = ap.parse_args(argv)
    path = str(a.model)
    top = max(a.streams)
    bare = Bare(path, top, a.temperature)
    engine = LLMEngine(
        a.model.name, path, max_batch=max(64, top), prompt_cache_entries=a.prompt_cache, reserve_context_tokens=0
    )  # no KV reservation held (M4 off), as BatchGenerator runs
    asyncio.run(engine.load())
    bare.run(2, 4, 0.0)  # warm-up: compile, caches
    asyncio.run(through_engine(engine, 2, 4, 0.0, a.temperature))
    for n in a.streams:  # every batch shape once, untimed (CUDA compiles kernels per shape on first use)
        bare.run(n, a.tokens, 1.0)
    rows = []
    variants = dict(parse_variant(v) for v in a.variant)
    print(
        "| streams | engine variant | bare tok/s | LLMEngine tok/s | ratio | rows/step bare / engine | ms/step bare / engine | TTFT p50 ms bare / engine | steps to a first token bare / engine |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.streams:
        sides: dict[str, list[dict]] = {"bare": [], **{name: [] for name in variants}}
        for _ in range(a.rounds):  # alternating: the machine's speed drifts
            sides["bare"].append(bare.run(n, a.tokens, a.seconds))
            for name, settings in variants.items():
                with variant(engine, settings):
                    sides[name].append(asyncio.run(through_engine(engine, n, a.tokens, a.seconds, a.temperature)))
        med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in sides.items()}
        b = med["bare"]
        for name in variants:
            e = med[name]
            ratios = sorted(x["tok_s"] / y["tok_s"] for y, x in zip(sides["bare"], sides[name], strict=True))
            rows.append({"streams": n, "variant": name, "bare": b, "engine": e, "ratio": statistics.median(ratios), "ratios": ratios})
            print(
                f"| {n} | {name} | {b['tok_s']:.0f} | {e['tok_s']:.0f} | {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
                f"{b['rows_per_step']:.1f} / {e['rows_per_step']:.1f} | {b['ms_per_step']:.2f} / {e['ms_per_step']:.2f} | "
                f"{b['ttft_p50_ms']:.1f} / {e['ttft_p50_ms']:.1f} | {b['first_token_steps']:.2f} / {e['first_token_steps']:.2f} |",
                flush=True,
            )
        if a.profile_dir is not None:
            a.profile_dir.mkdir(parents=True, exist_ok=True)
            out = a.profile_dir / f"engine-share-{n}.txt"
            cmd = [a.py_spy, "record", "-p", str(os.getpid()), "-d", str(int(a.seconds)), "-r", "200", "-f", "raw", "--threads", "--nonblocking"]
            spy = subprocess.Popen([*cmd, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            asyncio.run(through_engine(engine, n, a.tokens, a.seconds, a.temperature))
            spy.wait()
    asyncio.run(engine.stop())
    device = mx.device_info().get("device_name", str(mx.default_device()))
    result = {
        "model": a.model.name,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "seconds": a.seconds,
        "prompt_cache_entries": a.prompt_cache,
        "rows": rows,
        "machine": {"python": platform.python_version(), "cores": os.cpu_count(), "mlx": mx.__version__, "device": device},  # type: ignore[attr-defined]
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}", flush=True)
    # MLX's CUDA backend aborts at interpreter exit on the H200 ("terminate called without an
    # active exception") after everything is written: end here, so a chained command goes on.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
